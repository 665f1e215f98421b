"""Token ids -> text for the ensemble.

Stateless by nature (an ensemble step sees one response at a time), so when streaming each response's
tokens are decoded on their own, exactly like upstream's postprocessing. Clients that need streamed text
to join up exactly (spaces, multi-byte characters) use the OpenAI frontend, which detokenizes
incrementally.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


def _param(config: dict, key: str, default: str) -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value", default)
    return default if value.startswith("${") else value


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.tokenizer = AutoTokenizer.from_pretrained(_param(config, "tokenizer_dir", ""))
        self.skip_special_tokens = _param(config, "skip_special_tokens", "true").lower() == "true"

    def execute(self, requests):
        responses = []
        for request in requests:
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            texts = []
            for batch_tokens, batch_lengths in zip(tokens, lengths):
                for beam_tokens, length in zip(batch_tokens, batch_lengths):
                    ids = [int(t) for t in beam_tokens[: int(length)] if t >= 0]
                    texts.append(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens))
            output = np.asarray(texts, dtype=object).reshape(tokens.shape[0], -1)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", output)]))
        return responses

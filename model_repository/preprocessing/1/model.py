"""Text -> token ids for the ensemble, with the checkpoint's own tokenizer.

Raw Triton clients (and perf_analyzer) send text to the ensemble; the OpenAI frontend tokenizes itself
and calls `tensorrt_llm` directly.
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
        self.add_special_tokens = _param(config, "add_special_tokens", "false").lower() == "true"
        pad = self.tokenizer.pad_token_id
        self.end_id = self.tokenizer.eos_token_id
        self.pad_id = pad if pad is not None else self.end_id

    def execute(self, requests):
        responses = []
        for request in requests:
            queries = pb_utils.get_input_tensor_by_name(request, "QUERY").as_numpy().reshape(-1)
            output_len = pb_utils.get_input_tensor_by_name(request, "REQUEST_OUTPUT_LEN").as_numpy()
            batch = queries.shape[0]
            encoded = [
                self.tokenizer.encode(q.decode("utf-8") if isinstance(q, bytes) else str(q),
                                      add_special_tokens=self.add_special_tokens)
                for q in queries
            ]
            width = max(len(ids) for ids in encoded)
            input_ids = np.full((batch, width), self.pad_id, dtype=np.int32)
            for row, ids in enumerate(encoded):
                input_ids[row, : len(ids)] = ids
            lengths = np.asarray([[len(ids)] for ids in encoded], dtype=np.int32)
            end_id = pb_utils.get_input_tensor_by_name(request, "END_ID")
            pad_id = pb_utils.get_input_tensor_by_name(request, "PAD_ID")
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("INPUT_ID", input_ids),
                pb_utils.Tensor("REQUEST_INPUT_LEN", lengths),
                pb_utils.Tensor("REQUEST_OUTPUT_LEN", output_len.astype(np.int32).reshape(batch, -1)),
                pb_utils.Tensor("OUT_END_ID", end_id.as_numpy() if end_id is not None
                                else np.full((batch, 1), self.end_id, dtype=np.int32)),
                pb_utils.Tensor("OUT_PAD_ID", pad_id.as_numpy() if pad_id is not None
                                else np.full((batch, 1), self.pad_id, dtype=np.int32)),
            ]))
        return responses

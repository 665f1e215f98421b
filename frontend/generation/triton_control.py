"""Triton's side of the engine client that is not generation: the gRPC client itself, the model control API
(readiness, load, unload, the repository index; the control calls restricted with the launch's key), model
config parameters and the metadata read from them, and the stop-by-id request that doubles as the health
probe of an engine model whose process may be gone.

`TritonEngine` (triton_engine.py) builds on it for generation, over the same client.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from frontend.generation.engine import EngineMetadata
from frontend.generation.triton_errors import client_message, is_unavailable, model_gone
from frontend.generation.trtllm_tensors import stop_inputs
from frontend.api_types.errors import OpenAIError, service_unavailable


# Triton's gRPC server asks for a restricted protocol's key under this name: `triton-grpc-protocol-` + the
# header the launcher restricts the control API with (launcher/tritonserver.py CONTROL_HEADER).
CONTROL_KEY_METADATA = "triton-grpc-protocol-triton-control-key"
# The Python backend's answer for a model whose stub process is gone (killed, out of memory): the model stays
# READY and its open streams get nothing more, ever (launcher/engine_health.py has the measurements).
STUB_DEAD = "is not healthy"
PROBE_TIMEOUT_S = 5.0


class TritonControl:
    """Triton's control API and model configs for the engine model (TensorRT-LLM tensor interface): its
    readiness, loading and unloading, its config and the preprocessing model's config for metadata, and the
    stop-by-id request (`_stop`, `probe`). Owns the gRPC client, which `TritonEngine` generates over too."""

    def __init__(self, url: str, engine_model: str, preprocessing_model: str = "preprocessing",
                 metadata_timeout_s: float = 5.0, control_key: str | None = None):
        self.url = url
        self._control = {CONTROL_KEY_METADATA: control_key} if control_key else None
        self.engine_model = engine_model
        self.preprocessing_model = preprocessing_model
        self._timeout = metadata_timeout_s
        # Reconnect quickly after Triton restarts, instead of gRPC's default backoff of up to minutes.
        self._client = grpcclient.InferenceServerClient(url=url, channel_args=[
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])

    async def close(self) -> None:
        """Close the gRPC client."""
        await self._client.close()

    async def is_ready(self, model: str | None = None, version: str = "") -> bool:
        """One engine model ready in Triton (version "": the one Triton picks by its version policy). Not
        Triton's server readiness: under its strict readiness (the default) a model someone else unloaded
        (another model's rollout, a test's model) makes the whole server "not ready" for good."""
        try:
            return bool(await self._client.is_model_ready(model or self.engine_model, version,
                                                          client_timeout=self._timeout))
        except Exception:
            return False

    async def load_model(self, model: str) -> None:
        """Ask Triton (explicit model control) to load `model` as its config on disk now says: versions the
        version_policy added are loaded, versions it dropped unloaded, the others left serving. Raises
        InferenceServerException with Triton's reason when a version fails to load."""
        await self._client.load_model(model, headers=self._control)

    async def unload_model(self, model: str) -> None:
        """Ask Triton to unload every version of `model`; it returns once they are unloaded (a TensorRT-LLM
        executor finishes its in-flight requests first: executorImpl.cpp executionLoop)."""
        await self._client.unload_model(model, headers=self._control)

    async def parameter(self, model: str, key: str) -> str:
        """One parameter of the model's config ("" when it has none)."""
        return (await self._parameters(model)).get(key, "")

    async def model_index(self) -> dict[str, dict[str, str]]:
        """What Triton has loaded: model name -> {version: state} from its repository index (READY, LOADING,
        UNLOADING, UNAVAILABLE; a model in the repository that was never loaded has no versions). The index is
        a control API, restricted with the launch's key. 503 when Triton does not answer."""
        try:
            index = await self._client.get_model_repository_index(headers=self._control, as_json=True,
                                                                  client_timeout=self._timeout)
        except InferenceServerException as exc:
            raise service_unavailable(f"the inference server's repository index is not answering: "
                                      f"{client_message(exc.message())}") from exc
        models: dict[str, dict[str, str]] = {}
        for entry in index.get("models", []):
            versions = models.setdefault(entry.get("name", ""), {})
            if entry.get("version"):
                versions[str(entry["version"])] = entry.get("state", "")
        return models

    async def _stop(self, model: str, version: str, request_id: str) -> InferenceServerException | None:
        """Send a `stop` for `request_id` (`stop_inputs`) and read its stream to the end, which follows the
        answer: the engine's error answer, or None. Raises asyncio.TimeoutError without an end within
        PROBE_TIMEOUT_S, grpc.RpcError / InferenceServerException when Triton does not take it."""
        async def one_request():
            yield {"model_name": model, "model_version": version, "inputs": stop_inputs(), "request_id": request_id}

        call = self._client.stream_infer(one_request())

        async def answer() -> InferenceServerException | None:
            found = None
            async for _, error in call:
                found = found or error
            return found

        try:
            return await asyncio.wait_for(answer(), PROBE_TIMEOUT_S)
        finally:
            call.cancel()  # nothing once the stream has ended (`generate`); an unanswered stop is given up on

    async def probe(self, model: str, version: str = "") -> str | None:
        """The engine's answer to a `stop` for an id nobody uses when it says the model's process is gone
        (STUB_DEAD) or the model is no longer loaded; None when it answered otherwise, or not within
        PROBE_TIMEOUT_S."""
        try:
            error = await self._stop(model, version, f"health-probe-{uuid.uuid4().hex}")
        except (asyncio.TimeoutError, grpc.RpcError, InferenceServerException):
            return None
        if error is None:
            return None
        message = error.message() or ""
        return message if STUB_DEAD in message or model_gone(error) else None

    async def _parameters(self, model: str) -> dict[str, str]:
        try:
            config = await self._client.get_model_config(model, as_json=True, client_timeout=self._timeout)
        except InferenceServerException as exc:
            if is_unavailable(exc):
                raise service_unavailable("the inference server is unreachable") from exc
            raise service_unavailable(f"the inference server has no model {model!r} ready") from exc
        params = config.get("config", {}).get("parameters", {})
        return {key: value.get("string_value", "") for key, value in params.items()}

    async def metadata(self, model: str | None = None) -> EngineMetadata:
        engine = await self._parameters(model or self.engine_model)
        try:  # a repository may hold the engine model alone (the frontend is then given TOKENIZER_DIR)
            tokenizer_dir = (await self._parameters(self.preprocessing_model)).get("tokenizer_dir")
        except OpenAIError:
            tokenizer_dir = None
        max_seq_len = engine.get("max_seq_len", "")
        max_top_logprobs = engine.get("max_top_logprobs", "")
        # TensorRT-LLM reads normalize_log_probs as a C++ bool (model_state.cc GetParameter<bool>); absent or
        # unparsable, it uses its default, true. Only the CPU engine's own value says "model".
        normalize = engine.get("normalize_log_probs")
        log_probs = ("model" if normalize == "model" else "sampling" if normalize in ("False", "false", "FALSE", "0")
                     else "top_k_normalized")
        # Guided decoding (audit finding 8): off when guided_decoding_backend is empty or an unfilled "${...}", and
        # on TensorRT-LLM also when xgrammar_tokenizer_info_path is (model_instance_state.cc
        # getGuidedDecodingConfigFromParams: no error, guided requests then run unguided). The CPU engine reads
        # its tokenizer from tokenizer_dir and needs no info file.
        unset = [key for key in ("guided_decoding_backend", "xgrammar_tokenizer_info_path")
                 if engine.get(key, "") in ("", "${" + key + "}")]
        guided_decoding = not unset
        if unset == ["xgrammar_tokenizer_info_path"]:  # only TensorRT-LLM reads it: which backend is this?
            name = model or self.engine_model
            try:
                config = await self._client.get_model_config(name, as_json=True, client_timeout=self._timeout)
            except InferenceServerException as exc:
                raise service_unavailable(f"the inference server has no model {name!r} ready") from exc
            guided_decoding = config.get("config", {}).get("backend") != "tensorrtllm"
        return EngineMetadata(served_model_name=engine.get("served_model_name") or None,
                              tokenizer_dir=Path(tokenizer_dir) if tokenizer_dir else None,
                              context_length=int(max_seq_len) if max_seq_len.isdigit() else None,
                              max_top_logprobs=int(max_top_logprobs) if max_top_logprobs.isdigit() else 0,
                              log_probs=log_probs, guided_decoding=guided_decoding)

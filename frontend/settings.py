"""Every setting of the frontend, in one typed object.

Each field maps to an environment variable of the same name in upper case (FRONTEND_PORT) and to a CLI
flag in kebab case (--frontend-port); CLI flags win. The one exception is `api_keys`: a secret, taken
from the environment only (command lines show in `ps`). Settings left unset that Triton can tell us
(tokenizer directory, context length, served model name) are read from the model repository's configs
at start, so a plain `python -m frontend` next to a running Triton needs no flags.
"""

from __future__ import annotations

import ssl
import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, CliSuppress, SettingsConfigDict

from frontend.policy.auth import HashedKeys
from frontend.parsing.reasoning import REASONING_PARSERS
from frontend.parsing.tool_parsers import FAMILY_PARSERS

# Mozilla's "intermediate" TLS 1.2 suites (ssl-config.mozilla.org): forward secrecy and AEAD ciphers
# only. Its DHE suites are left out: this server loads no DH parameters, so they could never be chosen.
# TLS 1.3's suites are not set by this string (Python cannot configure them); OpenSSL's defaults stay on.
MOZILLA_INTERMEDIATE_CIPHERS = ":".join((
    "ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384", "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305", "ECDHE-RSA-CHACHA20-POLY1305",
))


class Settings(BaseSettings):
    # hide_input_in_errors: a validation error would otherwise print every raw input, API_KEYS included.
    # arbitrary_types_allowed: api_keys holds a HashedKeys (see its validator).
    model_config = SettingsConfigDict(extra="ignore", cli_kebab_case=True, cli_implicit_flags=True,
                                      hide_input_in_errors=True, arbitrary_types_allowed=True)

    frontend_host: str = Field("127.0.0.1", description="address to bind")
    frontend_port: int = Field(9000, description="port to bind")
    frontend_workers: int = Field(
        1, ge=1, le=64, description="worker processes serving the port (frontend/workers/supervisor.py): admission, rate "
                                    "limits, rollouts and /metrics stay the whole server's; more workers relay "
                                    "more tokens per second (one relays a few thousand); `make serve` picks one per "
                                    "core up to 8 for TensorRT-LLM engines, 1 for the CPU engine")
    triton_grpc_url: str = Field("127.0.0.1:8001", description="Triton gRPC endpoint host:port")
    triton_metrics_url: str | None = Field(
        None, description="Triton's metrics (http://127.0.0.1:8002/metrics): when set, GET /metrics serves them "
                          "after the frontend's own, so one port carries the engine's queue and KV-cache gauges "
                          "and Triton's ports can stay inside the host or pod")
    triton_metrics_cache_s: float = Field(
        1.0, ge=0, description="how long GET /metrics reuses Triton's metrics text before fetching it again (one "
                               "fetch at a time, whatever the number of scrapers; Triton refreshes its gauges "
                               "every 2 s); 0: fetch on every scrape")
    triton_control_key_file: Path | None = Field(
        None, description="file holding the key Triton's control API (model load/unload) asks for; `make serve` "
                          "makes one per launch (launcher/tritonserver.py); needed for rollouts")
    engine_stall_probe_s: float = Field(
        2.0, gt=0, description="a stream that has heard nothing from the engine this long makes the frontend probe "
                               "the engine model; if its process is dead, every stream on it ends with an error "
                               "at once instead of hanging")
    engine_stream_queue: int = Field(
        64, ge=1, description="engine responses (as tokens) that wait for a stream's client at most; a client that "
                              "reads no further stops its engine stream's reader there (gRPC flow control)")
    request_buffer_bytes: int = Field(
        4 * 1024 * 1024, ge=0, description="bytes of generated output that may wait for one request's client (all its "
                                           "choices); a client that reads too slowly past it ends the request (503 "
                                           "client_too_slow, or an error event); 0: only engine_stream_queue")
    engine_model: str = Field("tensorrt_llm", description="Triton model that runs the engine")
    preprocessing_model: str = Field("preprocessing", description="Triton model whose config names the tokenizer")
    model_repository: Path | None = Field(
        None, description="a repository of named models (`make engine NAME=...`): serve each of them at its live "
                          "version, instead of the one engine_model")
    served_model_name: str | None = Field(None, description="model id clients use; default: from Triton")
    tokenizer_dir: Path | None = Field(None, description="Hugging Face tokenizer dir; default: from Triton")
    context_length: int | None = Field(None, description="max prompt + completion tokens; default: from Triton")
    chat_template: Path | None = Field(None, description="Jinja chat template file overriding the tokenizer's")
    tool_call_parser: str | None = Field(
        None, description="how tool calls are read from answers (tool_choice auto): hermes, llama3_json or "
                          "mistral; default: recognised from the chat template, if it can be")
    reasoning_parser: str | None = Field(
        None, description="think: answers' <think>...</think> become reasoning_content; default: off")
    max_n: int = Field(8, description="largest n (choices per request) accepted")
    triton_timeout_s: float = Field(5.0, description="timeout for Triton metadata calls (not for generation)")
    log_prompts: bool = Field(False, description="log prompt and completion text (debugging only)")
    log_level: str = Field("info", description="uvicorn/app log level")
    access_log: bool = Field(True, description="one JSON line per request on stderr (no prompt text unless "
                                               "log_prompts)")
    # Authentication
    # Env only: `python -m frontend` refuses --api-keys (frontend.__main__), so the flag is hidden from --help.
    api_keys: CliSuppress[HashedKeys | None] = Field(
        None, description="API_KEYS: comma-separated API keys accepted as `Authorization: Bearer`, hashed at "
                          "load (never kept in plaintext); none and no file: the server is open")
    api_keys_file: Path | None = Field(None, description="file of API keys, one per line (# comments); "
                                                         "re-read on SIGHUP")
    # Administration (rollout, rollback): its own keys, never the API's. Env only, like api_keys.
    admin_api_keys: CliSuppress[HashedKeys | None] = Field(
        None, description="ADMIN_API_KEYS: comma-separated keys for /admin (model rollout and rollback), "
                          "separate from API_KEYS; none and no file: /admin refuses every request")
    admin_api_keys_file: Path | None = Field(None, description="file of admin keys, one per line; re-read on SIGHUP")
    rollout_grace_s: float = Field(60.0, ge=0, description="on rollout, how long requests on the old version may "
                                                           "take to finish before it is unloaded")
    rollout_hold_s: float = Field(300.0, gt=0, description="a rollout that swaps versions (TensorRT-LLM: one GPU "
                                                           "holds one engine) holds the model's new requests "
                                                           "while it does; past this wait they get a 503")
    console: bool = Field(True, description="serve the browser console at / (chat playground and live charts; "
                                            "static files in the package, no key in the page: it asks for one); "
                                            "false: / and /console/ are not routed")
    metrics_require_key: bool = Field(False, description="GET /metrics needs an API key too (when keys are set)")
    # Admission control
    max_in_flight: int = Field(64, ge=1, description="generation requests running at once; more wait in a queue")
    max_queued: int = Field(256, ge=0, description="requests waiting for a slot; past it: 429 + Retry-After")
    max_queue_wait_s: float = Field(30.0, gt=0, description="longest wait for a slot before 429 + Retry-After")
    rate_limit_rpm: int = Field(0, ge=0, description="requests per minute per API key (0: no limit)")
    rate_limit_tpm: int = Field(0, ge=0, description="tokens (prompt + max_tokens, settled with actual usage) "
                                                     "per minute per API key (0: no limit)")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1, description="largest request body; past it: 413")
    body_read_timeout_s: float = Field(30.0, gt=0, description="longest time to receive a request body; past "
                                                               "it: 408 and the connection is closed")
    max_engine_requests: int = Field(16, ge=1, description="most engine requests one HTTP request may start "
                                                           "(prompts x n); past it: 400")
    max_messages: int = Field(2048, ge=1, description="most chat `messages` in one request (chat, /tokenize), "
                                                      "counted before the body is validated; past it: 400")
    # at most the schemas' own bounds (responses_api/request.py MAX_INPUT_ITEMS, MAX_TOOLS; chat's tools)
    max_input_items: int = Field(1024, ge=1, le=1024, description="most Responses `input` items in one request, "
                                 "counted before the body is validated; past it: 400")
    max_tools: int = Field(128, ge=1, le=128, description="most `tools` in one request, counted before the body is "
                           "validated; past it: 400")
    max_stop_length: int = Field(1000, ge=1, description="longest stop string, in characters; past it: 400")
    tokenizer_threads: int = Field(4, ge=1, description="threads that tokenize and render chat templates, "
                                                        "off the event loop")
    guide_compile_threads: int = Field(2, ge=1, description="threads that compile requests' guides (xgrammar) "
                                                            "before any engine sees them, off the event loop")
    guide_compile_timeout_s: float = Field(2.0, gt=0, description="a guide that takes longer to compile is a 400 "
                                                                  "(the engine would stall every request as long)")
    guides_per_minute: int = Field(60, ge=0, description="new guides (schemas, regexes, grammars not sent before) "
                                                         "per TensorRT-LLM model per minute; past it: 429 (0: off)")
    limit_concurrency: int = Field(1024, ge=1, description="most open connections and tasks (uvicorn); past "
                                                           "it: 503")
    timeout_keep_alive_s: float = Field(5.0, gt=0, description="how long an idle keep-alive connection stays open")
    max_prompt_tokens: int = Field(0, ge=0, description="longest prompt in tokens (0: the context length); "
                                                        "past it: 400")
    # Deadlines and shutdown
    request_timeout_s: float = Field(600.0, gt=0, description="per-request deadline (504 `timeout`, or an error "
                                                              "event in a stream); X-Request-Timeout may lower it")
    shutdown_grace_s: float = Field(30.0, ge=0, description="on SIGTERM, how long requests in flight may finish "
                                                            "before they are cancelled")
    # Stored responses (/v1/responses with store, previous_response_id, background; frontend/responses_api/)
    responses_db_url: str = Field(
        f"sqlite:///{Path(tempfile.gettempdir()) / 'tritonllm' / 'responses.sqlite3'}",
        description="database of stored responses. Deploys must set it: sqlite:////tmp/responses.sqlite3 (one file, "
                    "shared by one machine's workers: one replica) or postgresql+asyncpg://user@host/db (shared by "
                    "replicas; the password from RESPONSES_DB_PASSWORD_FILE or RESPONSES_DB_PASSWORD). The default, a "
                    "file in this machine's temp dir (absolute, so a read-only working directory does not matter), "
                    "is for trying the server out; `make serve` puts the file in its work dir. The store is opened "
                    "when first needed: while it cannot be, /v1/responses answers 503 and everything else serves")
    responses_db_password_file: Path | None = Field(
        None, description="file holding the responses database's password (a mounted Kubernetes or compose "
                          "secret), put into RESPONSES_DB_URL; read at start")
    # Env only, like api_keys: `python -m frontend` refuses the flag (frontend.__main__).
    responses_db_password: CliSuppress[SecretStr | None] = Field(
        None, description="RESPONSES_DB_PASSWORD: the responses database's password (e.g. from a secretKeyRef), "
                          "put into RESPONSES_DB_URL")
    responses_ttl_days: float = Field(30.0, gt=0, description="stored responses expire this many days after "
                                                              "their creation (purged hourly)")
    responses_max_bytes: int = Field(4 * 1024 * 1024, ge=1, description="largest stored response (response, "
                                     "input items and stream events as JSON): a larger one is kept without its "
                                     "stream events (no replay), or failed if still too large; input alone "
                                     "larger is refused (400)")
    responses_max_chain_bytes: int = Field(
        16 * 1024 * 1024, ge=1, description="largest previous_response_id chain (JSON bytes of every input and "
                                            "output item in it): a request continuing a larger one is refused "
                                            "(400, param previous_response_id)")
    responses_stale_after_s: float = Field(
        30.0, gt=0, description="a background response whose process has not refreshed its heartbeat for this "
                                "long (the process died) reads as failed; refreshed every third of it")
    # Reasoning the client carries (include reasoning.encrypted_content; frontend/responses_api/sealing.py)
    # Env only, like api_keys: a secret.
    responses_reasoning_keys: CliSuppress[SecretStr | None] = Field(
        None, description="RESPONSES_REASONING_KEYS: comma-separated keys (32+ characters each) sealing the "
                          "reasoning returned as encrypted_content; the first seals, all open (rotation: the new "
                          "key first, the old one kept until turns in flight are done); every worker and replica "
                          "needs the same keys")
    responses_reasoning_keys_file: Path | None = Field(
        None, description="file of reasoning keys, one per line (# comments), the first sealing; neither set: a "
                          "key made once next to a SQLite responses_db_url (responses-reasoning.key), else per "
                          "process")
    # LoRA adapters (frontend/models/adapters.py): listed in /v1/models, selected by `model`
    lora_modules: str = Field("", description="LORA_MODULES: adapters served from the start, as vLLM's "
                              "--lora-modules: name=path,name=path or a JSON list of {name, path, base_model_name}")
    lora_max_rank: int = Field(64, ge=1, description="largest LoRA rank accepted (the engine's max_lora_rank / "
                               "lora_cache_max_adapter_size must be at least this)")
    lora_runtime_updates: bool = Field(False, description="allow POST /v1/load_lora_adapter and "
                                       "/v1/unload_lora_adapter (admin keys only), as vLLM's "
                                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    lora_state_file: Path | None = Field(None, description="where adapters loaded while serving are recorded, "
                                         "for every frontend worker (default: in memory, one worker only)")
    max_loras: int = Field(8, ge=1, description="the max_lora label of vllm:lora_requests_info: adapters an "
                           "engine batch runs at once (LoRA-affinity routing reads it)")
    # TLS
    ssl_certfile: Path | None = Field(None, description="PEM certificate: serve HTTPS (with ssl_keyfile)")
    ssl_keyfile: Path | None = Field(None, description="PEM private key of ssl_certfile")
    ssl_ciphers: str = Field(MOZILLA_INTERMEDIATE_CIPHERS, description="OpenSSL cipher string for TLS 1.2 "
                             "(TLS 1.3 suites are OpenSSL's defaults); TLS 1.0 and 1.1 are never served")

    @field_validator("api_keys", "admin_api_keys", mode="before")
    @classmethod
    def _hash_api_keys(cls, value: Any) -> HashedKeys | None:
        """Hash the keys as they are parsed, so that the plaintext is never stored on the settings object."""
        if value is None or isinstance(value, HashedKeys):
            return value
        if not isinstance(value, str):
            raise ValueError("API_KEYS must be a comma-separated string")  # the value itself is never echoed
        return HashedKeys.parse(value)

    @field_validator("responses_reasoning_keys")
    @classmethod
    def _long_reasoning_keys(cls, value: SecretStr | None) -> SecretStr | None:
        """Each key at least 32 characters (the message never echoes one)."""
        keys = [key.strip() for key in value.get_secret_value().split(",") if key.strip()] if value else []
        if value is not None and (not keys or any(len(key) < 32 for key in keys)):
            raise ValueError("RESPONSES_REASONING_KEYS: every key must be at least 32 characters")
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_call_parser(cls, value: str | None) -> str | None:
        if value and value not in FAMILY_PARSERS:
            raise ValueError(f"unknown tool-call parser {value!r}; known: {', '.join(FAMILY_PARSERS)}")
        return value or None

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_parser(cls, value: str | None) -> str | None:
        if value and value not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {value!r}; known: {', '.join(REASONING_PARSERS)}")
        return value or None

    @field_validator("ssl_ciphers")
    @classmethod
    def _ciphers_usable(cls, value: str) -> str:
        """Refuse a cipher string OpenSSL rejects, or one leaving no TLS 1.2 suite, at start, not at the
        first handshake."""
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(value)
        except ssl.SSLError:
            raise ValueError("ssl_ciphers: OpenSSL selects no TLS 1.2 cipher from this string") from None
        return value

    @model_validator(mode="after")
    def _lora_state_shared(self) -> "Settings":
        """Adapters loaded while serving must reach every worker: several workers share a state file."""
        if self.lora_runtime_updates and self.lora_state_file is None and self.frontend_workers > 1:
            self.lora_state_file = Path(tempfile.gettempdir()) / "tritonllm" / "lora_adapters.json"  # as the store
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> "Settings":
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile must be given together")
        if self.responses_db_password_file is not None and self.responses_db_password is not None:
            raise ValueError("set responses_db_password_file or responses_db_password, not both")
        return self

    def triton_control_key(self) -> str | None:
        """The key from `triton_control_key_file` (read when the engine client is made, never logged)."""
        if self.triton_control_key_file is None:
            return None
        key = self.triton_control_key_file.read_text(encoding="utf-8").strip()
        return key or None

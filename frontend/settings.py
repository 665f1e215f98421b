"""Every setting of the frontend, in one typed object.

Each field maps to an environment variable of the same name in upper case (FRONTEND_PORT) and to a CLI
flag in kebab case (--frontend-port); CLI flags win. Settings left unset that Triton can tell us
(tokenizer directory, context length, served model name) are read from the model repository's configs
at start, so a plain `python -m frontend` next to a running Triton needs no flags.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", cli_kebab_case=True, cli_implicit_flags=True)

    frontend_host: str = Field("127.0.0.1", description="address to bind")
    frontend_port: int = Field(9000, description="port to bind")
    triton_grpc_url: str = Field("127.0.0.1:8001", description="Triton gRPC endpoint host:port")
    engine_model: str = Field("tensorrt_llm", description="Triton model that runs the engine")
    preprocessing_model: str = Field("preprocessing", description="Triton model whose config names the tokenizer")
    served_model_name: str | None = Field(None, description="model id clients use; default: from Triton")
    tokenizer_dir: Path | None = Field(None, description="Hugging Face tokenizer dir; default: from Triton")
    context_length: int | None = Field(None, description="max prompt + completion tokens; default: from Triton")
    chat_template: Path | None = Field(None, description="Jinja chat template file overriding the tokenizer's")
    max_n: int = Field(8, description="largest n (choices per request) accepted")
    triton_timeout_s: float = Field(5.0, description="timeout for Triton metadata calls (not for generation)")
    log_prompts: bool = Field(False, description="log prompt and completion text (debugging only)")
    log_level: str = Field("info", description="uvicorn/app log level")

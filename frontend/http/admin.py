"""Administration routes: roll a named model's versions forward and back (`make rollout`, `make rollback`).

Guarded by admin keys (ADMIN_API_KEYS / ADMIN_API_KEYS_FILE), which are not API keys: an API client can
never change what serves. With no admin key configured every /admin request is refused (403); `make serve`
writes a random one to a file only its user can read (launcher/keys.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from frontend.policy.auth import bearer_token
from frontend.api_types.errors import OpenAIError, invalid_api_key

ADMIN_PREFIX = "/admin"


def admin_key(request: Request) -> None:
    keys = request.app.state.edge.admin_keys
    if not keys.enabled:
        raise OpenAIError(403, "Administration is disabled on this server: set ADMIN_API_KEYS or "
                               "ADMIN_API_KEYS_FILE to enable it.", "permission_error", None, "admin_disabled")
    token = bearer_token(request.headers.get("authorization"))
    key_id = keys.verify(token)
    if key_id is None:
        raise invalid_api_key("Provide an admin key as 'Authorization: Bearer <key>'." if token is None
                              else "Incorrect admin key provided.")
    request.state.ctx.key_id = f"admin:{key_id}"


router = APIRouter(prefix=ADMIN_PREFIX, dependencies=[Depends(admin_key)])


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int | None = Field(None, ge=1, description="the version to make live; default: the newest on disk")


@router.post("/models/{model_id}/rollout")
async def rollout(model_id: str, request: Request, body: RolloutRequest | None = None) -> dict[str, Any]:
    return await request.app.state.rollouts.rollout(model_id, body.version if body is not None else None)


@router.post("/models/{model_id}/rollback")
async def rollback(model_id: str, request: Request) -> dict[str, Any]:
    return await request.app.state.rollouts.rollback(model_id)


# ----- LoRA adapters loaded and unloaded while serving (vLLM's paths; frontend/models/adapters.py) -----------------
LORA_ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def lora_updates_enabled(request: Request) -> None:
    """Off unless LORA_RUNTIME_UPDATES, then admin keys only (the middleware leaves these paths to admin_key)."""
    if not request.app.state.settings.lora_runtime_updates:
        raise OpenAIError(403, "Loading LoRA adapters while serving is disabled on this server: set "
                               "LORA_RUNTIME_UPDATES to enable it.", "permission_error", None, "lora_updates_disabled")
    admin_key(request)


lora_router = APIRouter(dependencies=[Depends(lora_updates_enabled)])


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model_name: str | None = Field(None, max_length=256)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraRequest, request: Request) -> dict[str, Any]:
    return await request.app.state.models.load_adapter(body.lora_name, body.lora_path, body.base_model_name)


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraRequest, request: Request) -> dict[str, Any]:
    return await request.app.state.models.unload_adapter(body.lora_name)

"""The launcher's keys: the secrets it writes to files only this user can read (this launch's key to Triton's
control API, the admin key `make serve` makes when none is configured), and the keys it presents to its own
frontend (the banner's /v1/models call, `make rollout`). No key is ever printed.

Its own module because the entry point, the frontend process and the admin commands all use them.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_secret(path: Path, secret: str) -> Path:
    """`secret` in a file only this user can read, replacing any earlier one (made before it is written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secret + "\n")
    return path


def ensure_admin_key(path: Path) -> Path:
    """A random admin key in a file only this user can read, made once: with it `make rollout` can talk to
    `make serve`, and nobody else can, without anyone having to choose a key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secrets.token_urlsafe(32) + "\n")
    return path


def first_key(keys_var: str, file_var: str, fallback_file: Path | None = None) -> str | None:
    """The first key of a comma-separated variable, else of the key file a variable names (else of
    `fallback_file`): what the launcher presents to its own frontend (never printed)."""
    keys = [k.strip() for k in os.environ.get(keys_var, "").split(",") if k.strip()]
    if keys:
        return keys[0]
    for path in (os.environ.get(file_var), fallback_file):
        if not path:
            continue
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        keys = [k.strip() for k in lines if k.strip() and not k.strip().startswith("#")]
        if keys:
            return keys[0]
    return None


def probe_api_key() -> str | None:
    """A key for the launcher's own /v1/models call when the frontend requires keys."""
    return first_key("API_KEYS", "API_KEYS_FILE")

"""Reasoning sealed for the client to carry (include `reasoning.encrypted_content`, as with `store: false`):
authenticated encryption (Fernet: AES-128-CBC with HMAC-SHA256, from the pinned `cryptography`) under the
server's keys, so that a client carries its reasoning from turn to turn without reading or altering it, and any
worker or replica holding the same keys opens it on the next turn.

Keys (frontend/settings.py): RESPONSES_REASONING_KEYS (env only, comma-separated) or RESPONSES_REASONING_KEYS_FILE
(one a line, `#` comments); any text of 32 characters or more, each hashed (SHA-256) into a Fernet key. The first
key seals; every key opens: to rotate, put the new key first and keep the old one until the turns sealed under
it are done. Without either, a key is made once in the directory of a SQLite responses database (every worker
of this machine reads it), or, with PostgreSQL, per process (sealed reasoning then opens only in the process
that sealed it: set a key). Keys are never logged.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import secrets
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from sqlalchemy.engine import make_url

from frontend.api_types.errors import OpenAIError
from frontend.settings import Settings

log = logging.getLogger("frontend")

MIN_KEY_CHARS = 32
AUTO_KEY_FILE = "responses-reasoning.key"


class ReasoningSeal:
    def __init__(self, keys: list[str]):
        if not keys:
            raise ValueError("no reasoning keys")
        self._fernet = MultiFernet([Fernet(base64.urlsafe_b64encode(hashlib.sha256(key.encode()).digest()))
                                    for key in keys])

    def seal(self, text: str) -> str:
        return self._fernet.encrypt(json.dumps({"v": 1, "text": text}, ensure_ascii=False).encode()).decode()

    def open(self, blob: str, param: str) -> str:
        """The reasoning text sealed in `blob`; a 400 naming `param` if no key of ours sealed it as it is."""
        try:
            value = json.loads(self._fernet.decrypt(blob.encode("ascii", "replace")))
            return str(value["text"])
        except (InvalidToken, ValueError, KeyError, TypeError):
            raise OpenAIError(400, f"{param}: encrypted_content could not be verified: it was not sealed by this "
                                   "server's keys, or it was altered", "invalid_request_error", param.split(".")[0],
                              "invalid_encrypted_content") from None


def _keys_of(text: str) -> list[str]:
    return [line.strip() for line in text.replace(",", "\n").splitlines()
            if line.strip() and not line.strip().startswith("#")]


def _auto_key(settings: Settings) -> list[str]:
    url = make_url(settings.responses_db_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        path = Path(url.database).parent / AUTO_KEY_FILE
        if not path.exists():  # written whole, then linked into place: a worker never reads half a key
            path.parent.mkdir(parents=True, exist_ok=True)
            draft = path.with_name(f".{AUTO_KEY_FILE}.{os.getpid()}")
            fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as file:
                file.write(secrets.token_urlsafe(48) + "\n")
            try:
                os.link(draft, path)
            except FileExistsError:  # another worker's key is the key
                pass
            finally:
                draft.unlink()
        keys = _keys_of(path.read_text())
        if keys:
            return keys
    log.warning("no RESPONSES_REASONING_KEYS(_FILE): encrypted reasoning opens only in this process")
    return [secrets.token_urlsafe(48)]


def reasoning_seal(settings: Settings) -> ReasoningSeal:
    """The seal of these settings' keys (read once per process)."""
    keys: list[str] = []
    if settings.responses_reasoning_keys:
        keys = _keys_of(settings.responses_reasoning_keys.get_secret_value())
    elif settings.responses_reasoning_keys_file is not None:
        keys = _keys_of(settings.responses_reasoning_keys_file.read_text(encoding="utf-8"))
    else:
        keys = _auto_key(settings)
    if any(len(key) < MIN_KEY_CHARS for key in keys):
        raise ValueError(f"every reasoning key must be at least {MIN_KEY_CHARS} characters")
    return ReasoningSeal(keys)

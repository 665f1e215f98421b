"""API keys: `Authorization: Bearer <key>` checked against keys from API_KEYS and/or API_KEYS_FILE.

Keys are kept only as SHA-256 digests and a presented key is hashed before it is compared, with
`hmac.compare_digest` on the fixed-length digests against every stored digest (no early exit), so the
time a check takes depends neither on how much of a key matched nor on which key it was. Keys are never
logged; requests are attributed to a key by `key_id`, the first 8 hex digits of the key's digest.
The file (one key per line, blank lines and `#` comments ignored) is re-read by `reload()` (on SIGHUP);
a file that cannot be read keeps the keys loaded before and logs why.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

log = logging.getLogger("frontend.auth")

ANONYMOUS = "anonymous"


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_id_of(key_digest: bytes) -> str:
    return key_digest.hex()[:8]


def parse_keys(text: str, separator: str | None) -> list[str]:
    parts = text.split(separator) if separator else text.splitlines()
    return [p.strip() for p in parts if p.strip() and not p.strip().startswith("#")]


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class KeyStore:
    def __init__(self, keys: str | None = None, keys_file: Path | None = None):
        self._env_digests = [digest(k) for k in parse_keys(keys or "", ",")]
        self._file = keys_file
        self._file_digests: list[bytes] = []
        self._digests: tuple[bytes, ...] = ()
        if keys_file is not None:
            self._file_digests = self._read_file(keys_file)  # at start a bad file is fatal
        self._publish()

    @staticmethod
    def _read_file(path: Path) -> list[bytes]:
        return [digest(k) for k in parse_keys(Path(path).read_text(encoding="utf-8"), None)]

    def _publish(self) -> None:
        # One tuple swapped in atomically: a check in progress sees the old set or the new one.
        self._digests = tuple(dict.fromkeys(self._env_digests + self._file_digests))

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (API_KEYS_FILE set counts, even while the file is empty)."""
        return bool(self._digests) or self._file is not None

    def __len__(self) -> int:
        return len(self._digests)

    def reload(self) -> bool:
        """Re-read API_KEYS_FILE; keys from API_KEYS stay. False (old keys kept) if it cannot be read."""
        if self._file is None:
            return True
        try:
            self._file_digests = self._read_file(self._file)
        except (OSError, UnicodeDecodeError) as exc:
            log.error("API key file %s not reloaded (%s); keeping the %d key(s) loaded before",
                      self._file, type(exc).__name__, len(self._digests))
            return False
        self._publish()
        log.info("API keys reloaded from %s: %d key(s) active", self._file, len(self._digests))
        return True

    def verify(self, token: str | None) -> str | None:
        """The key id of a valid key, else None. Compares the digest against every stored digest."""
        if token is None:
            return None
        presented = digest(token)
        found: bytes | None = None
        for stored in self._digests:
            if hmac.compare_digest(presented, stored):
                found = stored
        return None if found is None else key_id_of(found)

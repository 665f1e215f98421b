"""API keys: `Authorization: Bearer <key>` checked against keys from API_KEYS and/or API_KEYS_FILE.

Keys come only from the environment or a file, never from a command line (`ps` shows every process's
arguments to every local user). They are hashed the moment they are read: the settings object holds a
`HashedKeys` (SHA-256 digests, whose repr names only how many there are) and the key store holds the same
digests, so no plaintext key outlives the parsing of its variable or file line.

A presented key is hashed before it is compared, with `hmac.compare_digest` on the fixed-length digests
against every stored digest (no early exit), so the time a check takes depends neither on how much of a
key matched nor on which key it was. Keys are never logged; requests are attributed to a key by `key_id`:
the first 12 hex digits (48 bits) of HMAC-SHA256 of the key's digest, keyed by a random salt drawn at
process start. Salted, because an unsalted hash prefix in a log is a fast offline test of a guessed or
leaked key; per server, because nobody has to manage it: the id is stable for the life of the process (and
of its sibling workers, which get the supervisor's salt: frontend/workers/supervisor.py), enough to group one key's
requests and to key its rate limits, and changes on restart. What must outlive a restart (the owner of a
stored response) is `owner_of`: a digest of the key's digest, never logged.
The file (one key per line, blank lines and `#` comments ignored) is re-read by `reload()` (on SIGHUP);
a file that cannot be read keeps the keys loaded before and logs why.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from pathlib import Path

log = logging.getLogger("frontend.policy.auth")

ANONYMOUS = "anonymous"
KEY_ID_HEX_DIGITS = 12  # 48 bits: no two of a few thousand keys share an id, short enough to read in a log
_KEY_ID_SALT = secrets.token_bytes(32)  # per process: see the module docstring


def use_key_id_salt(salt: bytes) -> None:
    """In a worker: the supervisor's salt, so that a key has one id across the server's workers (the rate
    limits of the coordinator are keyed by it). Before any KeyStore is made."""
    global _KEY_ID_SALT
    _KEY_ID_SALT = salt


def key_id_salt() -> bytes:
    return _KEY_ID_SALT


def owner_of(key_digest: bytes) -> str:
    """Who owns what a key stores (stored responses): the same across workers, replicas and restarts. A hash
    of the key's digest, so the database holds nothing that authenticates; not logged (unsalted, it would
    let a guessed key be checked offline against a log)."""
    return hashlib.sha256(b"tritonllm-owner:" + key_digest).hexdigest()


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_id_of(key_digest: bytes) -> str:
    """The loggable name of a key: salted (HMAC with this process's random salt), so not a hash of the key."""
    return hmac.new(_KEY_ID_SALT, key_digest, hashlib.sha256).hexdigest()[:KEY_ID_HEX_DIGITS]


class HashedKeys:
    """API keys from API_KEYS, hashed at parse time so that the settings object never holds plaintext.

    Not a str or tuple subclass on purpose: pydantic-settings then hands the raw environment string to
    the settings' validator (no JSON decoding), and nothing downstream can mistake the digests for keys.
    """

    __slots__ = ("digests",)

    def __init__(self, digests: tuple[bytes, ...]):
        self.digests = digests

    @classmethod
    def parse(cls, text: str) -> "HashedKeys":
        """Comma-separated keys (blanks and `#` entries ignored), each replaced by its SHA-256 digest."""
        return cls(tuple(digest(k) for k in parse_keys(text, ",")))

    def __len__(self) -> int:
        return len(self.digests)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashedKeys) and self.digests == other.digests

    def __hash__(self) -> int:
        return hash(self.digests)

    def __repr__(self) -> str:  # the count only: digests of weak keys could still be brute-forced
        return f"HashedKeys({len(self.digests)} key(s))"


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
    """The accepted keys, as digests: those of API_KEYS (fixed) and those of API_KEYS_FILE (reloadable)."""

    def __init__(self, keys: HashedKeys | str | None = None, keys_file: Path | None = None):
        # `keys` is what Settings.api_keys holds (already hashed); a str is hashed here (tests, embedding).
        hashed = keys if isinstance(keys, HashedKeys) else HashedKeys.parse(keys or "")
        self._env_digests = list(hashed.digests)
        self._file = keys_file
        self._file_digests: list[bytes] = []
        self._ids: dict[bytes, str] = {}  # digest -> key_id; replaced whole, never mutated
        if keys_file is not None:
            self._file_digests = self._read_file(keys_file)  # at start a bad file is fatal
        self._publish()

    @staticmethod
    def _read_file(path: Path) -> list[bytes]:
        return [digest(k) for k in parse_keys(Path(path).read_text(encoding="utf-8"), None)]

    def _publish(self) -> None:
        # One dict swapped in atomically: a check in progress sees the old set or the new one. The key ids
        # are computed here, once per key, not on every request.
        self._ids = {d: key_id_of(d) for d in dict.fromkeys(self._env_digests + self._file_digests)}

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (API_KEYS_FILE set counts, even while the file is empty)."""
        return bool(self._ids) or self._file is not None

    def __len__(self) -> int:
        return len(self._ids)

    def reload(self) -> bool:
        """Re-read API_KEYS_FILE; keys from API_KEYS stay. False (old keys kept) if it cannot be read."""
        if self._file is None:
            return True
        try:
            self._file_digests = self._read_file(self._file)
        except (OSError, UnicodeDecodeError) as exc:
            log.error("API key file %s not reloaded (%s); keeping the %d key(s) loaded before",
                      self._file, type(exc).__name__, len(self._ids))
            return False
        self._publish()
        log.info("API keys reloaded from %s: %d key(s) active", self._file, len(self._ids))
        return True

    def verify(self, token: str | None) -> str | None:
        """The key id of a valid key, else None. Compares the digest against every stored digest."""
        found = self.identify(token)
        return None if found is None else found[0]

    def identify(self, token: str | None) -> tuple[str, str] | None:
        """(key id, owner) of a valid key (`owner_of`), else None."""
        if token is None:
            return None
        presented = digest(token)
        ids = self._ids  # one snapshot: a reload during the loop cannot split it
        found: bytes | None = None
        for stored in ids:
            if hmac.compare_digest(presented, stored):
                found = stored
        return None if found is None else (ids[found], owner_of(found))

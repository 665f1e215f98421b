"""How the launcher reaches its own frontend on this machine: the readiness and liveness probes, the banner's
model ids, `make rollout`.

A wildcard bind address is reached on loopback. With SSL_CERTFILE and SSL_KEYFILE the frontend serves HTTPS,
and these requests use https with no certificate check: they only ever connect to this machine.
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request


def probe_host(host: str) -> str:
    """A wildcard bind address is not something to connect to; loopback reaches it."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def loopback_tls() -> ssl.SSLContext:
    """For probing our own frontend on this machine: encrypted, certificate not checked (it may well be
    self-signed, or issued for a public name rather than 127.0.0.1)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def http_get(url: str, timeout_s: float = 2.0, api_key: str | None = None) -> tuple[int, bytes] | None:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    context = loopback_tls() if url.startswith("https://") else None
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError):
        return None

"""The frontend's edge: TLS floor and ciphers, uvicorn limits, API keys kept out of settings and command
lines, salted key ids, and a compose file that publishes the frontend alone (Triton has no auth)."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
import yaml
from pydantic import ValidationError

from frontend.policy import auth
from frontend.__main__ import refuse_secret_flags
from frontend.server import MINIMUM_TLS, build_config, tls_context
from frontend.policy.auth import HashedKeys, KeyStore
from frontend.settings import MOZILLA_INTERMEDIATE_CIPHERS, Settings
from tests.tls import self_signed_certificate

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-unit-test-plaintext-0123456789"
TLS = ssl.TLSVersion


# ----- compose --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


def test_only_the_frontend_publishes_a_port(compose: dict) -> None:
    services = compose["services"]
    published = {name for name, service in services.items() if service.get("ports")}
    # The `monitoring` profile's Grafana (its own login; README "Console") is the one other published port.
    assert published == {"frontend", "grafana"}, "Triton has no auth: its ports must never be published"
    assert services["grafana"]["profiles"] == ["monitoring"] and services["grafana"]["ports"] == ["127.0.0.1:3000:3000"]
    assert "ports" not in services["triton"]
    for port in services["frontend"]["ports"]:
        assert port.endswith(":9000") and not any(p in port for p in (":8000", ":8001", ":8002"))


def test_triton_sits_on_an_internal_network_only_the_frontend_joins(compose: dict) -> None:
    networks, services = compose["networks"], compose["services"]
    internal = {name for name, network in (networks or {}).items() if (network or {}).get("internal")}
    assert set(services["triton"]["networks"]) <= internal and services["triton"]["networks"]
    joined = {name for name, service in services.items()
              if set(service.get("networks") or ()) & set(services["triton"]["networks"])}
    assert joined == {"triton", "frontend", "prometheus"}  # Prometheus (profile `monitoring`) scrapes it, unpublished
    assert services["prometheus"]["profiles"] == ["monitoring"] and "ports" not in services["prometheus"]
    assert "network_mode" not in services["triton"]
    assert services["frontend"]["environment"]["TRITON_GRPC_URL"] == "triton:8001"


# ----- uvicorn configuration ------------------------------------------------------------------------------
async def _ok(scope: dict, receive: object, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


def test_uvicorn_gets_the_connection_limits() -> None:
    config = build_config(_ok, Settings(limit_concurrency=7, timeout_keep_alive_s=2.5))
    assert config.limit_concurrency == 7 and config.timeout_keep_alive == 2.5
    assert not config.is_ssl and config.ssl_context_factory is None


def test_tls_floor_is_raised_to_1_2_and_never_lowered() -> None:
    def factory(minimum: ssl.TLSVersion):
        def make() -> ssl.SSLContext:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # TLSv1 is deprecated: that is the point
                context.minimum_version = minimum
            return context
        return make

    config = build_config(_ok, Settings())
    for lax in (TLS.MINIMUM_SUPPORTED, TLS.TLSv1, TLS.TLSv1_1):  # e.g. an OpenSSL config with MinProtocol
        assert tls_context(config, factory(lax)).minimum_version == MINIMUM_TLS == TLS.TLSv1_2
    assert tls_context(config, factory(TLS.TLSv1_3)).minimum_version == TLS.TLSv1_3


def test_cipher_setting_is_checked_at_start() -> None:
    assert Settings().ssl_ciphers == MOZILLA_INTERMEDIATE_CIPHERS
    assert Settings(ssl_ciphers="ECDHE-RSA-AES256-GCM-SHA384").ssl_ciphers == "ECDHE-RSA-AES256-GCM-SHA384"
    with pytest.raises(ValidationError, match="no TLS 1.2 cipher"):
        Settings(ssl_ciphers="NO-SUCH-CIPHER")


# ----- a live HTTPS server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def https_port(certificate: tuple[Path, Path]) -> Iterator[int]:
    """uvicorn, configured exactly as `python -m frontend` configures it, serving a trivial app."""
    cert, key = certificate
    settings = Settings(ssl_certfile=cert, ssl_keyfile=key, frontend_port=_free_port(), log_level="warning")
    server = uvicorn.Server(build_config(_ok, settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    assert server.config.ssl is not None and server.config.ssl.minimum_version == TLS.TLSv1_2
    yield settings.frontend_port
    server.should_exit = True
    thread.join(60)


def _client(version: ssl.TLSVersion, ciphers: str | None = None) -> ssl.SSLContext:
    """A client that offers exactly one protocol version (and, if given, only these TLS 1.2 ciphers)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = context.maximum_version = version
    if ciphers:
        context.set_ciphers(ciphers)
    return context


def _get(port: int, context: ssl.SSLContext) -> tuple[str | None, str, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as raw, context.wrap_socket(raw) as tls:
        tls.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        return tls.version(), tls.cipher()[0], tls.recv(64)


def _handshakes_with_a_lax_server(certificate: tuple[Path, Path], context: ssl.SSLContext) -> bool:
    """Control: whether this client can complete a handshake at all, against a server that allows anything.
    Without it, a refusal could be the client failing on its own (OpenSSL builds that drop TLS 1.1)."""
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        server_context.minimum_version = TLS.MINIMUM_SUPPORTED
    server_context.set_ciphers("ALL:@SECLEVEL=0")
    server_context.load_cert_chain(*certificate)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def accept() -> None:
            conn, _ = listener.accept()
            try:
                with server_context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                pass

        acceptor = threading.Thread(target=accept, daemon=True)
        acceptor.start()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=60) as raw, context.wrap_socket(raw):
                return True
        except (ssl.SSLError, OSError):
            return False
        finally:
            acceptor.join(60)


def test_tls_1_2_and_1_3_are_served_with_the_configured_ciphers(https_port: int) -> None:
    version, cipher, answer = _get(https_port, _client(TLS.TLSv1_2))
    assert version == "TLSv1.2" and cipher in MOZILLA_INTERMEDIATE_CIPHERS.split(":")
    assert answer.startswith(b"HTTP/1.1 200")
    version, _, answer = _get(https_port, _client(TLS.TLSv1_3))
    assert version == "TLSv1.3" and answer.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("version", ["TLSv1", "TLSv1_1"])
def test_tls_below_1_2_is_refused(https_port: int, certificate: tuple[Path, Path], version: str) -> None:
    old = _client(getattr(TLS, version), "DEFAULT:@SECLEVEL=0")  # seclevel 0: OpenSSL 3 may offer TLS 1.0/1.1
    if not _handshakes_with_a_lax_server(certificate, old):
        pytest.skip(f"this OpenSSL cannot speak {version} at all, so a refusal would prove nothing")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _get(https_port, old)


def test_a_tls_1_2_cipher_outside_the_setting_is_refused(https_port: int, certificate: tuple[Path, Path]) -> None:
    static_rsa = _client(TLS.TLSv1_2, "AES128-SHA")  # no forward secrecy: not in the default setting
    if not _handshakes_with_a_lax_server(certificate, static_rsa):
        pytest.skip("this OpenSSL does not offer AES128-SHA")
    with pytest.raises((ssl.SSLError, ConnectionError)):
        _get(https_port, static_rsa)


# ----- API keys -------------------------------------------------------------------------------------------
def test_settings_hash_api_keys_and_never_show_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_KEYS", f"{KEY}, sk-second-key,")
    settings = Settings()
    assert isinstance(settings.api_keys, HashedKeys) and len(settings.api_keys) == 2
    assert settings.api_keys.digests[0] == hashlib.sha256(KEY.encode()).digest()
    for shown in (repr(settings), str(settings), repr(settings.model_dump()), repr(vars(settings))):
        assert KEY not in shown and "sk-second-key" not in shown
    assert "HashedKeys(2 key(s))" in repr(settings)
    store = KeyStore(settings.api_keys, None)  # what the middleware builds from the settings
    assert store.verify(KEY) is not None and store.verify("sk-second-key") is not None
    assert store.verify("sk-other") is None
    assert Settings(api_keys=None).api_keys is None and len(Settings(api_keys=" , ").api_keys) == 0


def test_a_validation_error_does_not_print_the_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_KEYS", KEY)
    with pytest.raises(ValidationError) as raised:
        Settings(ssl_certfile="/only/the/certificate.pem")  # any error: pydantic would print every input
    assert KEY not in str(raised.value) and "must be given together" in str(raised.value)


@pytest.mark.parametrize("argv", [["--api-keys", KEY], [f"--api-keys={KEY}"],
                                  ["--log-level", "info", "--api_keys", KEY], ["--", "--api-keys", KEY]])
def test_api_keys_on_the_command_line_are_refused_without_echoing_them(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        refuse_secret_flags(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err
    assert "refused" in err and "API_KEYS" in err and KEY not in err


def test_other_flags_pass() -> None:
    refuse_secret_flags(["--api-keys-file", "/etc/keys", "--api-keys-file=/etc/keys", "--frontend-port", "9000"])


def test_python_m_frontend_refuses_api_keys_before_doing_anything() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("API_KEYS", "SSL_"))}
    result = subprocess.run([sys.executable, "-m", "frontend", "--frontend-port", "1", "--api-keys", KEY],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--api-keys is refused" in result.stderr and KEY not in result.stderr + result.stdout


def test_key_id_is_a_salted_hmac_not_a_hash_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{KEY}\n")
    from_env, from_file = KeyStore(KEY, None).verify(KEY), KeyStore(None, keys_file).verify(KEY)
    assert from_env == from_file and from_env is not None  # stable within the process, whatever the source
    assert len(from_env) == auth.KEY_ID_HEX_DIGITS == 12 and int(from_env, 16) >= 0
    assert from_env not in hashlib.sha256(KEY.encode()).hexdigest()  # not computable from the key alone
    monkeypatch.setattr(auth, "_KEY_ID_SALT", b"another process" * 2)
    assert KeyStore(KEY, None).verify(KEY) != from_env  # another process, another salt


def test_the_frontend_image_healthcheck_speaks_https_when_tls_is_on(https_port: int) -> None:
    dockerfile = (ROOT / "docker" / "Dockerfile.frontend").read_text()
    exec_form = dockerfile.split("HEALTHCHECK", 1)[1].split("CMD ", 1)[1].split("\n", 1)[0]
    probe = yaml.safe_load(exec_form)  # a JSON array, which YAML reads too
    assert probe[:2] == ["python", "-c"]
    env = {**os.environ, "FRONTEND_PORT": str(https_port), "SSL_CERTFILE": "/run/secrets/cert.pem"}
    assert subprocess.run([sys.executable, "-c", probe[2]], env=env, capture_output=True, timeout=30).returncode == 0
    env.pop("SSL_CERTFILE")  # plain http against the https port: the probe must fail, not pass by accident
    assert subprocess.run([sys.executable, "-c", probe[2]], env=env, capture_output=True, timeout=30).returncode != 0

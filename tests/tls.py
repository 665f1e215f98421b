"""A throwaway self-signed certificate for tests that serve HTTPS (unit and integration)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) for CN=localhost, made with the openssl command line; skips without openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key

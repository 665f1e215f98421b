"""Init step of every server pod: a new random key for Triton's control APIs, known to this pod only.

Triton serves its model-repository, trace, logging and shared-memory APIs (HTTP and gRPC) only to requests
that carry the header `triton-control-key: <key>` (--http-restricted-api, --grpc-restricted-protocol); the
frontend sends it when it loads or unloads a model. The key is made here, at every start of the pod, into
TRITON_CONTROL_KEY_FILE on an in-memory emptyDir: never on a disk, in a manifest, a Secret or an environment
variable. The file is readable by the pod's user only (0400; every container of the pod runs as that uid):
Triton's container reads it into tritonserver's arguments (no other pod sees that process's argv), the
frontend reads the file (TRITON_CONTROL_KEY_FILE, the same path).

Standard library only: it runs in the Triton image.
"""

from __future__ import annotations

import os
import secrets


def write_key(path: str) -> None:
    """A 256-bit key as 64 hex digits, written whole (rename) with mode 0400, replacing any earlier one."""
    staging = f"{path}.new"
    if os.path.lexists(staging):  # left by a start that was interrupted
        os.unlink(staging)
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    os.replace(staging, path)


if __name__ == "__main__":
    write_key(os.environ["TRITON_CONTROL_KEY_FILE"])

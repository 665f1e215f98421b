"""`python -m frontend [--flags]`: run the OpenAI frontend with uvicorn (HTTPS with --ssl-certfile/keyfile).

HTTPS is TLS 1.2 or 1.3 only (never lower, whatever OpenSSL's configuration allows), with `ssl_ciphers` for
TLS 1.2. API keys come from API_KEYS or API_KEYS_FILE only: `--api-keys` is refused, since a command line
is readable by every local user (`ps`, /proc/<pid>/cmdline) and lands in shell history.

SIGTERM (or a first Ctrl+C) drains: new requests get 503 and /health/ready turns 503 while the listener
stays open, requests in flight get `shutdown_grace_s` to finish, the rest are cancelled (streams end with
an error event and [DONE]), then uvicorn stops. A second signal stops at once. SIGHUP reloads API_KEYS_FILE.

FRONTEND_WORKERS=N (N > 1) runs N worker processes on the one port, each the server above, under a supervisor
(frontend/workers/supervisor.py) that shares the limits and rollouts among them, passes signals on and
restarts a worker that dies.
"""

from __future__ import annotations

import os
import sys

# gRPC's classic client I/O path: the default event-engine client reads each stream message on its own
# threads and hands it to grpc.aio's poller, one more thread hop and wake-up per streamed token; without it
# the frontend spends ~15-30% less CPU per token at 64-256 streams (benchmarks/README.md, "Frontend
# benchmark"). Read once, when grpc is first imported, so it is set before anything imports it (workers
# inherit it); an operator's own GRPC_EXPERIMENTS wins.
os.environ.setdefault("GRPC_EXPERIMENTS", "-event_engine_client")

from collections.abc import Sequence

from frontend.observability.logs import configure_logging
from frontend.settings import Settings

SECRET_FLAGS = ("--api-keys", "--api_keys", "--admin-api-keys", "--admin_api_keys", "--responses-reasoning-keys",
                "--responses_reasoning_keys", "--responses-db-password",
                "--responses_db_password")  # settings that must never be given on a command line


def refuse_secret_flags(argv: Sequence[str]) -> None:
    """Exit (status 2, as argparse does) if a secret is passed as a flag; the message never echoes it."""
    for arg in argv:  # anywhere, even after `--`: the key would be in `ps` all the same
        if arg.partition("=")[0] in SECRET_FLAGS:
            print(f"error: {arg.partition('=')[0]} is refused: a secret on a command line is readable by every "
                  "local user (ps, /proc/<pid>/cmdline) and stays in shell history. Set it in the environment "
                  "(API_KEYS=<key>[,<key>...], ADMIN_API_KEYS, RESPONSES_DB_PASSWORD) or name a file "
                  "(API_KEYS_FILE: one key per line, reloaded on SIGHUP; ADMIN_API_KEYS_FILE; "
                  "RESPONSES_DB_PASSWORD_FILE).", file=sys.stderr)
            sys.exit(2)


def main() -> None:
    refuse_secret_flags(sys.argv[1:])  # before parsing, so that the refusal is clear and nothing is echoed
    settings = Settings(_cli_parse_args=True)
    configure_logging(settings.log_level, settings.access_log)
    # Imported here, each only where it runs: the supervisor's process never loads the app (tokenizers,
    # xgrammar and torch: hundreds of MB), only each worker does.
    if settings.frontend_workers > 1:
        from frontend.workers import supervisor
        sys.exit(supervisor.serve(settings, sys.argv[1:], app="frontend.server:run"))
    from frontend import server
    server.run(settings)


if __name__ == "__main__":
    main()

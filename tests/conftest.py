"""Fixtures for every test directory: a real PostgreSQL server for the tests of code that can use one.

`postgresql_url` starts a throwaway PostgreSQL cluster once per test session (only when a test asks for
it): initdb into a temp dir, the server listening on a Unix socket in that dir only (no TCP), on a free
port number (which names the socket). It yields the URL of a database created for the session and stops
the server (`pg_ctl stop -m fast`) however the session ends. No binaries → the tests that need it FAIL,
naming what to install: CI machines have PostgreSQL, so a silent skip would hide the missing half of the
test matrix. The binaries are looked up as $PG_BIN, then on PATH, then the newest
/usr/lib/postgresql/<version>/bin (Debian's layout, which is not on PATH).

As root (CI runs as root), initdb and postgres refuse to run: the cluster is then run as the `postgres`
system user that Debian's package creates, with the temp dir handed to it.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from launcher.ports import find_free_port

PG_USER = "tester"  # the cluster's superuser (trust auth: only reachable through the socket in our temp dir)
PG_DATABASE = "tests"
PG_START_TIMEOUT_S = 120  # pg_ctl -w waits for the server to accept connections, up to this


def postgresql_bin_dir() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres, or None."""
    candidates: list[Path] = []
    if os.environ.get("PG_BIN"):
        candidates.append(Path(os.environ["PG_BIN"]))
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(part) for part in re.findall(r"\d+", path.parent.name))

    candidates.extend(sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True))
    for directory in candidates:
        if all((directory / name).is_file() for name in ("initdb", "pg_ctl", "postgres", "createdb")):
            return directory
    return None


def _run_as(user: pwd.struct_passwd | None) -> dict[str, Any]:
    """subprocess arguments that run a command as `user` (None: as ourselves)."""
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [],
            "env": {**os.environ, "HOME": user.pw_dir, "USER": user.pw_name}}


class PostgreSQLServer:
    """A throwaway PostgreSQL cluster (module docstring): `start()` and `stop()` may alternate (the same data
    dir, socket and port each time, so a URL stays valid across a restart); `close()` stops it and deletes it."""

    def __init__(self) -> None:
        bin_dir = postgresql_bin_dir()
        if bin_dir is None:
            pytest.fail("PostgreSQL server binaries (initdb, pg_ctl, postgres, createdb) not found on PATH, in "
                        "$PG_BIN or under /usr/lib/postgresql/*/bin: install them (Debian: apt-get install "
                        "postgresql) to run the PostgreSQL half of these tests", pytrace=False)
        self.bin_dir = bin_dir
        self.run_as: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            try:
                self.run_as = pwd.getpwnam("postgres")
            except KeyError:
                pytest.fail("running as root, and PostgreSQL refuses to: no `postgres` user to run it as "
                            "(Debian's postgresql package creates one)", pytrace=False)
        # Under /tmp, not $TMPDIR: a Unix socket path may not exceed 107 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="pg-tests-", dir="/tmp" if Path("/tmp").is_dir() else None))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.port = find_free_port()
        if self.run_as is not None:
            os.chown(self.root, self.run_as.pw_uid, self.run_as.pw_gid)
        self.url = f"postgresql://{PG_USER}@/{PG_DATABASE}?host={self.root}&port={self.port}"
        try:
            self._run(str(bin_dir / "initdb"), "-D", str(self.data), "-U", PG_USER, "--auth=trust",
                      "--encoding=UTF8", "--no-sync", "--no-instructions")
            self.start()
            self._run(str(bin_dir / "createdb"), "-h", str(self.root), "-p", str(self.port), "-U", PG_USER,
                      PG_DATABASE)
        except BaseException:
            self.close()
            raise

    def _run(self, *command: str) -> None:
        done = subprocess.run(command, cwd=self.root, capture_output=True, text=True, timeout=PG_START_TIMEOUT_S,
                              **_run_as(self.run_as))
        if done.returncode != 0:
            server_log = self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""
            pytest.fail(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}\n"
                        f"server log:\n{server_log}", pytrace=False)

    def start(self) -> None:
        """Start the server and return once it accepts connections (pg_ctl -w)."""
        # fsync off: a test cluster need not survive a power cut, and this keeps the tests I/O-cheap.
        options = f"-k {self.root} -p {self.port} -c listen_addresses='' -c fsync=off -c full_page_writes=off"
        self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options,
                  "-w", "-t", str(PG_START_TIMEOUT_S), "start")

    def stop(self) -> None:
        """Stop the server (fast: open connections are closed) and return once it has."""
        if (self.data / "postmaster.pid").exists():
            subprocess.run([str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"],
                           cwd=self.root, capture_output=True, timeout=PG_START_TIMEOUT_S, **_run_as(self.run_as))

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgresql_url() -> Iterator[str]:
    server = PostgreSQLServer()
    try:
        yield server.url
    finally:
        server.close()

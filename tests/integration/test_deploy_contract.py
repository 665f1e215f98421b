"""What ships starts as shipped: every deploy target's frontend, started exactly as that target declares it.

For docker/compose.yaml and for each rendered deploy/kubernetes overlay, the frontend container is read from
the files (no restatement here): its environment, command, user and groups, which mounts exist and which of
them are writable, and whether the root filesystem is read-only; the image it runs, from
docker/Dockerfile.frontend: USER, WORKDIR, ENV, CMD/ENTRYPOINT, the user `useradd` creates, its VOLUMEs and
what its COPY lines put under WORKDIR. The real frontend (`python -m frontend`, the checkout's code mounted
where the image copies it) then runs in a mount namespace of its own (`unshare -m`) under a new root:
the machine's system and this venv's Python read-only, WORKDIR with the image's files, read-only; only the
target's writable mounts (emptyDirs, compose tmpfs, volumes) writable; Secrets as files with their modes and
group; then `chroot` + `setpriv` to the target's uid/gid/groups with no capabilities and no_new_privs. It talks
to the session's Triton (tests/integration/conftest.py) and to the session's real PostgreSQL
(tests/conftest.py) where the target names PostgreSQL. Each target must:
  - become ready (/health/ready), answer one chat completion,
  - store a response (POST /v1/responses) through one frontend and read it back (GET) through another one
    started the same way (a second pod / container sharing the store),
  - open, in both frontends, reasoning sealed under the target's shared reasoning key file (what one
    process's `encrypted_content` must be to open in another: the Codex CLI sends it back every turn), and
    refuse what another key sealed. The targets run no reasoning parser, so no frontend seals reasoning of
    its own here: the test seals it with frontend.responses_api.sealing under the key it put in the declared file,
    and both frontends, each reading that file as its uid, must open it (a per-process key would refuse it).

What only exists where the target runs is substituted, each in SUBSTITUTIONS below and nowhere else: the
assertion at the end of `launch()` checks that nothing else differs from the target's own values.

Targets whose frontend is declared identically (gpu, tp and multinode render one frontend) run once; the
others reuse that run's outcome (the comparison itself is part of the test).

Needs root (mount namespaces, chroot, setpriv), as CI runs; util-linux's unshare/setpriv and coreutils' chroot.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from benchmarks.servers import repository_parameter, stop_process, wait_http_ok
from frontend.responses_api.sealing import ReasoningSeal
from launcher.ports import find_free_port
from tests.integration.conftest import Stack
from tests.unit.test_kubernetes_manifests import container, render, server_pod

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile.frontend"
COMPOSE = REPO / "docker" / "compose.yaml"
TARGETS = ("compose", "kubernetes/cpu", "kubernetes/gpu", "kubernetes/tp", "kubernetes/multinode")
READY_TIMEOUT_S = 300  # a hang guard (several workers importing torch on a busy 2-core machine), not a speed

# The base image's own environment (python:3.12-slim-bookworm), which Dockerfile.frontend builds on.
BASE_IMAGE_ENV = {"PATH": "/usr/local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                  "LANG": "C.UTF-8"}

# Everything the test puts in place of a target's own value, and why. Nothing else is changed.
SUBSTITUTIONS = {
    "env TRITON_GRPC_URL": "the test Triton's gRPC address (the pod's 127.0.0.1:8001, compose's triton:8001)",
    "env TRITON_HTTP_URL": "the test Triton's HTTP address (the pod's 127.0.0.1:8000)",
    "env TRITON_METRICS_URL": "the test Triton's metrics URL (the pod's http://127.0.0.1:8002/metrics)",
    "env FRONTEND_PORT": "a free port: 9000 is one per pod there, one per machine here",
    "env PATH": "this venv's bin first: its python stands in for the image's /usr/local/bin/python",
    "env RESPONSES_DB_URL": "the DSN's host and port only: the test PostgreSQL's socket (user, database, "
                            "options as declared)",
    "env OPENBLAS_*": "this machine's OpenBLAS settings, where set (numpy's OpenBLAS needs them on some CPUs)",
    "secret contents": "the test's values: an API key, a database password, a reasoning key",
    "triton control key": "the test Triton's, in the file the pod's init container writes",
    "tokenizer": "the test engine's checkpoint, read-only, where the test Triton's config names it (the "
                 "target's own model volume is there, empty)",
}


# ----- the image ------------------------------------------------------------------------------------------
@dataclass
class Image:
    user: str = "root"
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    users: dict[str, tuple[int, str]] = field(default_factory=dict)  # useradd: name -> (uid, home)
    copies: list[tuple[Path, str]] = field(default_factory=list)  # (source in the build context, path in image)

    def uid_gid(self, user: str | None = None) -> tuple[int, int]:
        name, _, group = (user or self.user).partition(":")
        uid = int(name) if name.isdigit() else self.users[name][0]
        return uid, int(group) if group else uid  # useradd's default: a group of the user's own, same id

    def home(self, uid: int) -> str:
        return next((home for known, home in self.users.values() if known == uid), "/")


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip()]


def exec_form(value: str) -> list[str]:
    return json.loads(value) if value.startswith("[") else ["/bin/sh", "-c", value]


def read_image(path: Path = DOCKERFILE) -> Image:
    image = Image()
    for instruction, value in dockerfile_instructions(path):
        if instruction == "FROM":
            image = Image()  # the last stage is the image
        elif instruction == "ENV":
            for pair in shlex.split(value):
                key, _, val = pair.partition("=")
                image.env[key] = val
        elif instruction == "USER":
            image.user = value
        elif instruction == "WORKDIR":
            image.workdir = os.path.join(image.workdir, value)
        elif instruction in ("CMD", "ENTRYPOINT"):
            setattr(image, instruction.lower(), exec_form(value))
        elif instruction == "VOLUME":
            image.volumes += json.loads(value) if value.startswith("[") else value.split()
        elif instruction == "COPY":
            *sources, dest = shlex.split(value)
            target = os.path.normpath(os.path.join(image.workdir, dest))
            for source in sources:
                into = dest.endswith("/") or len(sources) > 1
                image.copies.append((REPO / source, os.path.join(target, Path(source).name) if into else target))
        elif instruction == "RUN":
            for match in re.finditer(r"useradd\b([^&;|]*)", value):
                words = shlex.split(match.group(1))
                uid = int(words[words.index("--uid") + 1])
                image.users[words[-1]] = (uid, f"/home/{words[-1]}")
    return image


# ----- what a target declares -----------------------------------------------------------------------------
@dataclass
class Secret:
    path: str  # the file in the container
    content_of: str  # which test value: "api-keys", "responses-db-password", "reasoning-keys"
    mode: int
    gid: int | None  # the file's group (a pod's fsGroup); None: root's


@dataclass
class Launch:
    """How a target starts its frontend, as declared (before substitutions)."""
    target: str
    argv: list[str]
    env: dict[str, str]  # the environment the container gets, secrets still symbolic (see secret_env)
    secret_env: dict[str, str]  # env name -> test value name, for env from a Secret
    uid: int
    gid: int
    groups: list[int]
    workdir: str
    read_only_root: bool
    writable: list[str]  # paths of writable mounts
    read_only: list[str]  # paths of read-only mounts the test has no content for (model volumes, ...)
    secrets: list[Secret]
    control_key: str | None  # the file Triton's control key is in, where the target has one

    def fingerprint(self) -> str:
        """Equal for two targets that start their frontend identically (the order mounts are listed in aside)."""
        data = {k: v for k, v in self.__dict__.items() if k != "target"}
        data.update(writable=sorted(self.writable), read_only=sorted(self.read_only),
                    secrets=sorted((s.path, s.content_of, s.mode, s.gid) for s in self.secrets))
        return json.dumps(data, sort_keys=True, default=lambda o: o.__dict__)


def compose_launch(image: Image) -> Launch:
    spec = importlib.util.spec_from_file_location("validate_compose", REPO / "docker" / "validate_compose.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    # The variables compose needs to parse the file; their values are only interpolated into host paths.
    model = module.load(COMPOSE, {"MODEL_DIR": "/models/hf", "RESPONSES_DB_PASSWORD_FILE": "/run/pw",
                                  "RESPONSES_REASONING_KEYS_FILE": "/run/rk"})
    service = model["services"]["frontend"]
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.partition("=")[::2] for item in environment)
    # A key with no value is passed through from the shell that runs compose: this test's has none of them.
    env = {k: str(v) for k, v in environment.items() if v is not None}
    uid, gid = image.uid_gid(service.get("user"))
    argv = (exec_form(service["entrypoint"]) if isinstance(service.get("entrypoint"), str)
            else service.get("entrypoint") or image.entrypoint)
    command = service.get("command")
    argv = list(argv) + (list(command) if isinstance(command, list) else exec_form(command) if command else
                         ([] if service.get("entrypoint") else image.cmd))
    writable = list(service.get("tmpfs", []))
    read_only = []
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":") if isinstance(volume, str) else (
            volume.get("source", ""), volume["target"], "ro" if volume.get("read_only") else "rw")
        (read_only if mode and mode[0] == "ro" else writable).append(target)
    if not service.get("read_only"):
        writable += image_writable(image, uid)
    secrets = []
    for entry in service.get("secrets", []):
        name = entry if isinstance(entry, str) else entry["source"]
        target = f"/run/secrets/{name}" if isinstance(entry, str) else entry.get("target", f"/run/secrets/{name}")
        assert name in COMPOSE_SECRETS, f"compose secret {name}: which test value is it?"
        secrets.append(Secret(target, COMPOSE_SECRETS[name], 0o644, None))  # a host file, as the README asks
    return Launch("compose", argv, env, {}, uid, gid, [], service.get("working_dir", image.workdir),
                  bool(service.get("read_only")), writable, read_only, secrets, None)


COMPOSE_SECRETS = {"responses_db_password": "responses-db-password", "responses_reasoning_keys": "reasoning-keys"}


def image_writable(image: Image, uid: int) -> list[str]:
    """Where the image's user may write on a writable root filesystem: /tmp, its home, the VOLUMEs."""
    return ["/tmp", image.home(uid), *image.volumes]


K8S_SECRETS = {("tritonllm-api-keys", "keys"): "api-keys", ("tritonllm-responses-db", "password"): "responses-db-password",
               ("tritonllm-reasoning-keys", "keys"): "reasoning-keys"}
_K8S_VAR = re.compile(r"\$\((\w+)\)|\$\$")


def k8s_expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion (of earlier variables; `$$` escapes; unknown names stay as written)."""
    return _K8S_VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def kubernetes_launch(overlay: str, image: Image) -> Launch:
    docs = render(overlay)
    pod = server_pod(docs)
    spec, frontend = pod["spec"], container(pod, "frontend")
    env: dict[str, str] = {}
    secret_env: dict[str, str] = {}
    for item in frontend.get("env", []):
        if "value" in item:
            env[item["name"]] = k8s_expand(item["value"], env)
            continue
        ref = item["valueFrom"]
        if "secretKeyRef" in ref:
            secret_env[item["name"]] = K8S_SECRETS[(ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])]
            env[item["name"]] = f"<secret {secret_env[item['name']]}>"
        elif "configMapKeyRef" in ref:
            cm = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref["configMapKeyRef"]["name"]]
            env[item["name"]] = cm[0]["data"][ref["configMapKeyRef"]["key"]]
        else:
            raise AssertionError(f"env {item['name']}: {ref} is not read by this test yet")
    security = {**spec.get("securityContext", {}), **frontend.get("securityContext", {})}
    uid, gid = image.uid_gid()
    uid, gid = security.get("runAsUser", uid), security.get("runAsGroup", gid)
    fs_group = spec.get("securityContext", {}).get("fsGroup")
    groups = sorted({g for g in (fs_group, *spec.get("securityContext", {}).get("supplementalGroups", [])) if g is not None})
    command = [k8s_expand(a, env) for a in frontend.get("command", [])]
    args = [k8s_expand(a, env) for a in frontend.get("args", [])]
    argv = (command or image.entrypoint) + (args or ([] if command else image.cmd))
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    writable, read_only, secrets = [], [], []
    control_key = env.get("TRITON_CONTROL_KEY_FILE")
    for mount in frontend.get("volumeMounts", []):
        volume, path = volumes[mount["name"]], mount["mountPath"]
        if "secret" in volume:
            source = volume["secret"]
            items = source.get("items") or [{"key": key, "path": key} for (name, key) in K8S_SECRETS
                                             if name == source["secretName"]]
            for item in items:
                secrets.append(Secret(f"{path}/{item['path']}", K8S_SECRETS[(source["secretName"], item["key"])],
                                      item.get("mode", source.get("defaultMode", 0o644)), fs_group))
        elif mount.get("readOnly") or volume.get("persistentVolumeClaim", {}).get("readOnly"):
            read_only.append(path)
        elif "emptyDir" in volume or "persistentVolumeClaim" in volume:
            writable.append(path)
        else:
            raise AssertionError(f"volume {volume}: not read by this test yet")
    if not security.get("readOnlyRootFilesystem"):
        writable += image_writable(image, uid)
    return Launch(f"kubernetes/{overlay}", argv, env, secret_env, uid, gid, groups,
                  frontend.get("workingDir", image.workdir), bool(security.get("readOnlyRootFilesystem")),
                  writable, read_only, secrets, control_key)


def declared_launch(target: str) -> Launch:
    image = read_image()
    launch = compose_launch(image) if target == "compose" else kubernetes_launch(target.split("/", 1)[1], image)
    # What the container runtime gives every container: the image's ENV over the base image's, HOME from the
    # user's passwd entry (when no one sets it), then the target's environment over them.
    launch.env = {**BASE_IMAGE_ENV, **image.env, "HOME": image.home(launch.uid), **launch.env}
    return launch


# ----- the session's services, and the test's values ----------------------------------------------------
@dataclass
class Services:
    stack: Stack
    api_key: str
    db_password: str
    reasoning_key: str  # the one line of the reasoning key file the targets share
    pg_socket: Path  # the test PostgreSQL's socket file
    pg_port: int
    pg_admin_url: str
    tokenizer: Path


@pytest.fixture(scope="module")
def services(stack: Stack, postgresql_url: str) -> Services:
    if os.geteuid() != 0:
        pytest.fail("the deploy contract test needs root (mount namespaces, chroot, setpriv to the target's uid); "
                    "CI runs as root", pytrace=False)
    for tool in ("unshare", "setpriv", "chroot", "mount"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} not found (util-linux / coreutils)", pytrace=False)
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(postgresql_url).query)
    port = int(query["port"][0])
    tokenizer = repository_parameter(stack.repository, "preprocessing", "tokenizer_dir")
    assert tokenizer, "the test Triton's preprocessing config names no tokenizer_dir"
    return Services(stack, api_key="deploy-contract-key", db_password="deploy-contract-password",
                    reasoning_key="deploy-contract-reasoning-key-of-32-characters-or-more",
                    pg_socket=Path(query["host"][0]) / f".s.PGSQL.{port}", pg_port=port,
                    pg_admin_url=postgresql_url, tokenizer=Path(tokenizer))


def ensure_database(services: Services, user: str, database: str) -> None:
    """The role and database a DSN names, in the test PostgreSQL (which trusts its socket: the password is
    set, not checked)."""
    password = services.db_password.replace("'", "''")
    statements = [
        f"DO $$BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{user}') THEN "
        f"CREATE ROLE \"{user}\" LOGIN PASSWORD '{password}'; END IF; END$$",
    ]
    psql = shutil.which("psql") or "psql"
    run = lambda sql: subprocess.run([psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", services.pg_admin_url,
                                      "-tAc", sql], check=True, capture_output=True, text=True, timeout=60).stdout
    for sql in statements:
        run(sql)
    if not run(f"SELECT 1 FROM pg_database WHERE datname = '{database}'").strip():
        run(f'CREATE DATABASE "{database}" OWNER "{user}"')


# ----- substitutions --------------------------------------------------------------------------------------
PG_SOCKET_DIR = "/run/deploy-contract-postgresql"  # where the sandbox sees the test PostgreSQL's socket


def substitute(launch: Launch, services: Services, port: int) -> tuple[dict[str, str], list[str]]:
    """The environment the frontend gets here, and the SUBSTITUTIONS keys used."""
    env, used = dict(launch.env), []

    def put(key: str, name: str, value: str) -> None:
        env[name] = value
        used.append(key)

    stack = services.stack
    for name, value in launch.secret_env.items():
        put("secret contents", name, secret_values(services)[value].strip())
    if "TRITON_GRPC_URL" in env:
        put("env TRITON_GRPC_URL", "TRITON_GRPC_URL", stack.triton_grpc_url)
    if "TRITON_HTTP_URL" in env:
        put("env TRITON_HTTP_URL", "TRITON_HTTP_URL", stack.triton_http_url.removeprefix("http://"))
    if "TRITON_METRICS_URL" in env:
        put("env TRITON_METRICS_URL", "TRITON_METRICS_URL", stack.triton_metrics_url)
    put("env FRONTEND_PORT", "FRONTEND_PORT", str(port))
    put("env PATH", "PATH", f"{Path(sys.prefix) / 'bin'}:{env['PATH']}")
    for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        if name in os.environ:
            put("env OPENBLAS_*", name, os.environ[name])
    url = env.get("RESPONSES_DB_URL", "")
    if url.startswith(("postgresql", "postgres")):
        parts = urllib.parse.urlsplit(url)
        query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k not in ("host", "port")]
        query += [("host", PG_SOCKET_DIR), ("port", str(services.pg_port))]
        netloc = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        put("env RESPONSES_DB_URL", "RESPONSES_DB_URL",
            urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, urllib.parse.urlencode(query), "")))
    assert set(used) <= set(SUBSTITUTIONS), set(used) - set(SUBSTITUTIONS)
    return env, used


# ----- the sandbox ----------------------------------------------------------------------------------------
SYSTEM_DIRS = ("/usr", "/sys")  # read-only, as an image's system files are (/etc too: see sandbox_script)
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")  # merged-/usr links, where they are links


def sandbox_script(launch: Launch, services: Services, root: Path, staging: Path, image: Image,
                   control_key: str | None) -> str:
    q = shlex.quote
    lines = ["set -eu", f"R={q(str(root))}",
             'ro() { if [ -d "$1" ]; then mkdir -p "$R$2"; else mkdir -p "$(dirname "$R$2")"; [ -e "$R$2" ] || : > "$R$2"; fi; '
             'mount --bind "$1" "$R$2"; mount -o remount,bind,ro "$R$2"; }',
             'mount -t tmpfs -o mode=0755 deploy-contract-root "$R"']
    for directory in SYSTEM_DIRS:
        lines.append(f"ro {q(directory)} {q(directory)}")
    for link in SYSTEM_LINKS:
        if os.path.islink(link):
            lines.append(f"ln -s {q(os.readlink(link))} \"$R\"{q(link)}")
        elif os.path.isdir(link):
            lines.append(f"ro {q(link)} {q(link)}")
    # This machine's Python: the venv and the interpreter it was made from, where they are.
    for directory in dict.fromkeys((sys.prefix, sys.base_prefix)):
        lines.append(f"ro {q(directory)} {q(directory)}")
    # /etc: the machine's, entry by entry, read-only, in a folder of its own (targets mount Secrets under
    # /etc), with the image's users (useradd) added to passwd and group.
    lines += ['mkdir "$R/etc"; mount -t tmpfs -o mode=0755 etc "$R/etc"',
              'for entry in /etc/* /etc/.[!.]*; do name=${entry#/etc/}; case "$name" in passwd|group) continue;; esac; '
              'if [ -L "$entry" ]; then cp -P "$entry" "$R/etc/$name"; elif [ -e "$entry" ]; then ro "$entry" "/etc/$name"; fi; done']
    lines.append(f"ro {q(str(staging / 'passwd'))} /etc/passwd")
    lines.append(f"ro {q(str(staging / 'group'))} /etc/group")
    lines += ['mkdir -p "$R/proc" "$R/dev" "$R/tmp" "$R/run"', 'mount -t proc proc "$R/proc"',
              'mount -t tmpfs -o mode=0755 dev "$R/dev"']
    for node in ("null", "zero", "full", "random", "urandom"):
        lines.append(f'ro /dev/{node} /dev/{node}; mount -o remount,bind,rw "$R/dev/{node}"')
    lines += ['mkdir "$R/dev/shm"; mount -t tmpfs -o mode=1777 shm "$R/dev/shm"',
              'ln -s /proc/self/fd "$R/dev/fd"; ln -s fd/0 "$R/dev/stdin"; ln -s fd/1 "$R/dev/stdout"; '
              'ln -s fd/2 "$R/dev/stderr"']
    # The image's own files under WORKDIR (its COPY lines), root's and read-only, as in the image.
    for source, target in image.copies:
        lines.append(f"ro {q(str(source))} {q(target)}")
    # The target's writable mounts: empty, writable by anyone (an emptyDir's 0777; tmpfs 1777).
    for path in launch.writable:
        lines.append(f'mkdir -p "$R"{q(path)}; mount -t tmpfs -o mode=1777 writable "$R"{q(path)}')
    # Its read-only mounts the test has nothing for: there, empty, read-only.
    for path in launch.read_only:
        lines.append(f'mkdir -p "$R"{q(path)}')
    # Secrets and the control key: files as Kubernetes / compose lay them out, read-only.
    for index, secret in enumerate(launch.secrets):
        lines.append(f"ro {q(str(staging / f'secret-{index}'))} {q(secret.path)}")
    if control_key is not None:
        lines.append(f"ro {q(str(staging / 'control-key'))} {q(control_key)}")
    # The tokenizer where the test Triton names it, and the test PostgreSQL's socket.
    lines.append(f"ro {q(str(services.tokenizer))} {q(str(services.tokenizer))}")
    socket = f"{PG_SOCKET_DIR}/{services.pg_socket.name}"
    lines.append(f'mkdir -p "$R"{q(PG_SOCKET_DIR)}; : > "$R"{q(socket)}; '
                 f'mount --bind {q(str(services.pg_socket))} "$R"{q(socket)}')
    # Declared read-only mounts stay read-only inside writable ones; then the root itself goes read-only.
    for path in launch.read_only:
        lines.append(f'mount --bind "$R"{q(path)} "$R"{q(path)}; mount -o remount,bind,ro "$R"{q(path)}')
    # The root: read-only (a target whose root filesystem is writable gets the image user's writable places
    # as mounts of their own instead: image_writable()).
    lines.append('mount -o remount,ro "$R/etc"; mount -o remount,ro "$R"')
    groups = ",".join(map(str, launch.groups)) if launch.groups else ""
    setpriv = ["setpriv", f"--reuid={launch.uid}", f"--regid={launch.gid}",
               f"--groups={groups}" if groups else "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
               "--no-new-privs"]
    lines.append(f'exec chroot "$R" /bin/sh -c \'cd "$0" && exec "$@"\' {q(launch.workdir)} '
                 + " ".join(q(a) for a in setpriv + launch.argv))
    return "\n".join(lines) + "\n"


def secret_values(services: Services) -> dict[str, str]:
    """The contents of the test's secret files, by test value name."""
    return {"api-keys": services.api_key + "\n", "responses-db-password": services.db_password + "\n",
            "reasoning-keys": services.reasoning_key + "\n"}


def stage_files(launch: Launch, services: Services, staging: Path, image: Image) -> None:
    staging.mkdir(parents=True)
    passwd = Path("/etc/passwd").read_text()
    group = Path("/etc/group").read_text()
    for name, (uid, home) in image.users.items():
        passwd += f"{name}:x:{uid}:{uid}::{home}:/usr/sbin/nologin\n"
        group += f"{name}:x:{uid}:\n"
    (staging / "passwd").write_text(passwd)
    (staging / "group").write_text(group)
    values = secret_values(services)
    for index, secret in enumerate(launch.secrets):
        path = staging / f"secret-{index}"
        path.write_text(values[secret.content_of])
        os.chown(path, 0, secret.gid if secret.gid is not None else 0)
        path.chmod(secret.mode)
    if launch.control_key is not None:  # as base/scripts/triton_control_key.py writes it: the pod's uid, 0400
        path = staging / "control-key"
        path.write_text(services.stack.triton_control["triton-control-key"] + "\n")
        os.chown(path, launch.uid, launch.gid)
        path.chmod(0o400)


@dataclass
class Running:
    process: subprocess.Popen
    url: str
    log: Path


def start(launch: Launch, services: Services, work: Path, name: str) -> Running:
    image = read_image()
    port = find_free_port()
    env, _ = substitute(launch, services, port)
    staging, root = work / f"{name}-files", work / f"{name}-root"
    stage_files(launch, services, staging, image)
    root.mkdir()
    script = work / f"{name}.sh"
    script.write_text(sandbox_script(launch, services, root, staging, image, launch.control_key))
    log = work / f"{name}.log"
    # The container's environment only (nothing of this process's); the script's own commands are on its PATH.
    process = subprocess.Popen([shutil.which("unshare") or "unshare", "--mount", "--propagation", "private",
                                "/bin/bash", str(script)], env=env, stdin=subprocess.DEVNULL,
                               stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return Running(process, f"http://127.0.0.1:{port}", log)


# ----- the test -------------------------------------------------------------------------------------------
OUTCOMES: dict[str, str | None] = {}  # fingerprint of a declared frontend -> None (passed) or why it failed


def exercise(launch: Launch, services: Services, work: Path) -> None:
    url = launch.env.get("RESPONSES_DB_URL", "")
    if url.startswith(("postgresql", "postgres")):
        parts = urllib.parse.urlsplit(url)
        ensure_database(services, parts.username or "postgres", parts.path.lstrip("/"))
    pods = [start(launch, services, work, f"frontend-{i}") for i in (1, 2)]  # two pods/containers, one store

    def logs() -> str:
        return "\n".join(f"--- {p.log.name} (last lines)\n" + "\n".join(p.log.read_text(errors="replace").splitlines()[-25:])
                         for p in pods)

    try:
        for pod in pods:
            try:
                wait_http_ok(f"{pod.url}/health/ready", READY_TIMEOUT_S, pod.process)
            except (RuntimeError, TimeoutError) as exc:
                raise AssertionError(f"{launch.target}: the frontend never became ready ({exc})\n{logs()}") from None
        headers = {"Authorization": f"Bearer {services.api_key}"}
        with httpx.Client(headers=headers, timeout=120) as client:
            model = client.get(f"{pods[0].url}/v1/models").json()["data"][0]["id"]
            chat = client.post(f"{pods[0].url}/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
            assert chat.status_code == 200, f"{launch.target}: chat {chat.status_code} {chat.text}\n{logs()}"
            assert chat.json()["usage"]["completion_tokens"] >= 1
            created = client.post(f"{pods[0].url}/v1/responses", json={
                "model": model, "input": "Hello", "max_output_tokens": 4, "store": True})
            assert created.status_code == 200, f"{launch.target}: store {created.status_code} {created.text}\n{logs()}"
            stored = client.get(f"{pods[1].url}/v1/responses/{created.json()['id']}")
            assert stored.status_code == 200, \
                f"{launch.target}: the other frontend cannot read it: {stored.status_code} {stored.text}\n{logs()}"
            assert stored.json()["id"] == created.json()["id"]
            assert stored.json()["output"] == created.json()["output"]
            check_shared_reasoning_key(launch, services, client, pods, model, logs)
        for pod in pods:  # what the frontends logged never carries a secret
            text = pod.log.read_text(errors="replace")
            for secret in (services.db_password, services.api_key, services.reasoning_key):
                assert secret not in text, f"{pod.log}: a secret is logged"
    finally:
        for pod in pods:
            stop_process(pod.process)


def check_shared_reasoning_key(launch: Launch, services: Services, client: httpx.Client, pods: list[Running],
                               model: str, logs: Any) -> None:
    """Both frontends (started identically: one declared key file, staged once per frontend with the same
    contents, readable by the target's uid) open reasoning sealed under the shared key, and refuse what a
    process-local key sealed. Sealed here, not by a frontend: the targets run no reasoning parser, so their
    outputs carry no reasoning to seal."""
    declared = launch.env.get("RESPONSES_REASONING_KEYS_FILE")
    assert declared, f"{launch.target}: no RESPONSES_REASONING_KEYS_FILE: each process would seal under its own key"
    assert "RESPONSES_REASONING_KEYS" not in launch.env, f"{launch.target}: reasoning keys in env"
    [key_file] = [s for s in launch.secrets if s.path == declared]
    assert key_file.content_of == "reasoning-keys", f"{launch.target}: {declared} is not the reasoning-keys secret"
    shared, stranger = ReasoningSeal([services.reasoning_key]), ReasoningSeal(["another-process-key-" + "x" * 32])
    question = {"role": "user", "content": "Hello"}

    def turn(url: str, seal: ReasoningSeal) -> httpx.Response:
        reasoning = {"type": "reasoning", "id": "rs_deploy_contract", "summary": [],
                     "encrypted_content": seal.seal("Thinking about hello.")}
        return client.post(f"{url}/v1/responses", json={
            "model": model, "input": [question, reasoning, {"role": "assistant", "content": "Hi."}, question],
            "max_output_tokens": 2, "store": False, "include": ["reasoning.encrypted_content"]})

    for pod in pods:
        opened = turn(pod.url, shared)
        assert opened.status_code == 200, \
            f"{launch.target}: {pod.url} cannot open reasoning sealed under the shared key: " \
            f"{opened.status_code} {opened.text}\n{logs()}"
        refused = turn(pod.url, stranger)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_encrypted_content", \
            f"{launch.target}: reasoning sealed under another key: {refused.status_code} {refused.text}"


@pytest.mark.parametrize("target", TARGETS)
def test_target_starts_as_shipped(target: str, services: Services, tmp_path: Path) -> None:
    launch = declared_launch(target)
    key = launch.fingerprint()
    if key not in OUTCOMES:
        started = time.monotonic()
        try:
            exercise(launch, services, tmp_path)
        except AssertionError as exc:
            OUTCOMES[key] = str(exc)
            raise
        OUTCOMES[key] = None
        print(f"{target}: ready, chat, a stored response read back and shared reasoning keys in "
              f"{time.monotonic() - started:.0f} s")
    elif OUTCOMES[key] is not None:
        pytest.fail(f"{target} declares its frontend as an earlier target does, which failed:\n{OUTCOMES[key]}")


def test_image_and_targets_are_read_from_the_files() -> None:
    """The parsing the contract test relies on reads what the files say (no servers)."""
    image = read_image()
    assert image.uid_gid() == (10001, 10001) and image.workdir == "/app"
    assert image.cmd == ["python", "-m", "frontend"]
    assert (REPO / "frontend", "/app/frontend") in image.copies
    for target in TARGETS:
        launch = declared_launch(target)
        assert launch.uid == 10001 and launch.read_only_root, target
        assert "/tmp" in launch.writable, target
        # Each frontend runs the image's own command, its secrets read from files by the frontend itself.
        assert launch.argv == image.entrypoint + image.cmd, f"{target}: {launch.argv}"
        files = {s.content_of: s.path for s in launch.secrets}
        assert launch.env["RESPONSES_DB_PASSWORD_FILE"] == files["responses-db-password"], target
        assert launch.env["RESPONSES_REASONING_KEYS_FILE"] == files["reasoning-keys"], target
        assert not launch.secret_env, f"{target}: secrets in env"

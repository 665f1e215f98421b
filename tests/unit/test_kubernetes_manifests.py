"""deploy/kubernetes: the rendered manifests agree with the code they deploy.

Each overlay is rendered with `kubectl kustomize` (kubectl is on these machines and in CI) and compared with
what `make serve` does: the launcher's ports, environment and health checks (launcher/config.py and
launcher/processes.py, read by calling them, not restated here), the frontend's routes, the commands of the
Makefile's `serve` target. A changed port, probe path or command in the code fails here until the manifests
follow. Also checked: what the schema validation of `make lint` cannot see in the custom resources
(InferencePool, LeaderWorkerSet), that every metric name the autoscaler and the endpoint picker read is one
the model servers export (tests/integration/test_kubernetes_metrics.py scrapes a running CPU stack's frontend
for the same names), and that Triton stays inside the pod: no container exposes its ports, nothing binds them
to all interfaces, and the endpoint picker and Prometheus read the engine's gauges on the frontend's /metrics
(TRITON_METRICS_URL). Also: Triton's liveness is the engine model's readiness; every pod serves the engine of
its own ENGINE_KEY, never a link a re-run Job could move; Triton's control APIs are behind a key made per pod,
in memory, shared with the frontend only; the endpoint picker scrapes as often as the frontend refreshes
Triton's metrics.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

import launcher.processes as launcher_processes
import launcher.tritonserver as launcher_tritonserver
from build_engine.trtllm import checkpoint_sha256
from launcher.__main__ import build_parser
from launcher.config import Config, load_config
from launcher.mpi import tritonserver_argv
from frontend.observability.metrics import ENGINE_WAITING
from frontend.http.routes import router
from frontend.settings import Settings

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "tp", "multinode")
# Gateway API Inference Extension v1.5.0, docs/proposals/003-model-server-protocol: Triton TensorRT-LLM's
# names for the signals the endpoint picker reads.
PROTOCOL_TRTLLM = {
    "queuedRequestsSpec": "nv_trt_llm_request_metrics{request_type=waiting}",
    "runningRequestsSpec": "nv_trt_llm_request_metrics{request_type=scheduled}",
    "kvUsageSpec": "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}",
}
# Triton's default ports, as the launcher and the manifests use them (checked against the launcher below).
TRITON_PORTS = {8000, 8001, 8002}
LAUNCHER_ENV = ("FRONTEND_HOST", "FRONTEND_PORT", "TRITON_HTTP_PORT", "TRITON_GRPC_PORT", "TRITON_METRICS_PORT",
                "ENGINE_MODEL", "SHUTDOWN_GRACE_S", "TRITON_READY_TIMEOUT", "SSL_CERTFILE", "SSL_KEYFILE",
                "API_KEYS", "API_KEYS_FILE", "MAX_RESTARTS_PER_MINUTE")


# ----- rendering and lookups (also used by the integration test) ---------------------------------------
@cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    """Every resource of one overlay, as `kubectl kustomize` renders it."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/kubernetes (it ships kustomize)"
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def resource(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def server_pod(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """The serving pod's template: the Deployment's, or the LeaderWorkerSet leader's."""
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "tritonllm":
            return doc["spec"]["template"]
        if doc["kind"] == "LeaderWorkerSet":
            return doc["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    raise AssertionError("no server pod rendered")


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    spec = pod["spec"]
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"container {name}: {len(found)}"
    return found[0]


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def ports_of(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def pod_specs(node: Any) -> list[dict[str, Any]]:
    """Every pod spec in a rendered resource (Deployment, Job, LeaderWorkerSet leader and worker, ...)."""
    if isinstance(node, dict):
        found = [node] if isinstance(node.get("containers"), list) else []
        return found + [spec for value in node.values() for spec in pod_specs(value)]
    if isinstance(node, list):
        return [spec for item in node for spec in pod_specs(item)]
    return []


def all_containers(docs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [c for doc in docs for spec in pod_specs(doc) for c in spec.get("initContainers", []) + spec["containers"]]


def epp_config(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return yaml.safe_load(resource(docs, "ConfigMap", "tritonllm-endpoint-picker")["data"]["epp.yaml"])


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """A metric spec as the endpoint picker writes it, `name{label=value,...}`, into name and labels."""
    match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?", spec)
    assert match, f"not a metric spec: {spec!r}"
    labels = dict(pair.split("=", 1) for pair in match.group(2).split(",")) if match.group(2) else {}
    return match.group(1), {k.strip(): v.strip().strip('"') for k, v in labels.items()}


def picker_metrics(docs: tuple[dict[str, Any], ...]) -> dict[str, tuple[str, dict[str, str]]]:
    """What the endpoint picker reads from this overlay's pods: the engine config named by their label."""
    engine = server_pod(docs)["metadata"]["labels"]["inference.networking.k8s.io/engine-type"]
    extractor = next(p for p in epp_config(docs)["plugins"] if p["type"] == "core-metrics-extractor")
    configs = {c["name"]: c for c in extractor["parameters"]["engineConfigs"]}
    assert engine in configs, f"pods say engine {engine!r}; the picker knows {sorted(configs)}"
    return {field: parse_spec(spec) for field, spec in configs[engine].items() if field.endswith("Spec") and spec}


def adapter_rules() -> dict[str, tuple[str, dict[str, str]]]:
    """prometheus-adapter's rules: custom metric name -> the series (name, label filter) it comes from."""
    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    rules = {}
    for rule in values["rules"]["custom"]:
        name, labels = parse_spec(rule["seriesQuery"].strip("'"))
        labels = {k: v for k, v in labels.items() if not k.endswith("!")}  # namespace!="", pod!=""
        rules[rule["name"]["as"]] = (name, labels)
    return rules


def autoscaler_metrics(docs: tuple[dict[str, Any], ...]) -> dict[str, tuple[str, dict[str, str]]]:
    """The series behind each metric the HPA scales on (through prometheus-adapter)."""
    hpa = resource(docs, "HorizontalPodAutoscaler", "tritonllm")
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    rules = adapter_rules()
    missing = [n for n in names if n not in rules]
    assert not missing, f"the HPA asks for {missing}, which no prometheus-adapter rule provides"
    return {name: rules[name] for name in names}


# ----- what `make serve` does, asked from the code -----------------------------------------------------
@pytest.fixture
def launcher_config(monkeypatch: pytest.MonkeyPatch) -> Config:
    """The launcher's defaults, bound to all interfaces as a pod must be (FRONTEND_HOST=0.0.0.0 make serve)."""
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FRONTEND_HOST", "0.0.0.0")
    return load_config(build_parser().parse_args(["serve"]))


def launcher_frontend_env(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment `make serve` starts the frontend with (start_frontend, its Popen intercepted)."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(launcher_processes.subprocess, "Popen", lambda argv, env, **kw: seen.update(argv=argv, env=env))
    launcher_processes.start_frontend(cfg)
    assert seen["argv"][1:] == ["-m", "frontend"]
    return seen["env"]


def launcher_probe_paths(cfg: Config, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, list[str]]:
    """The URL paths the launcher probes: frontend readiness, frontend liveness, Triton readiness."""
    urls: list[str] = []
    monkeypatch.setattr(launcher_processes, "http_get", lambda url, *a, **kw: urls.append(url) or (200, b""))
    alive = SimpleNamespace(poll=lambda: None)
    launcher_processes.wait_frontend_ready(cfg, alive, alive)  # type: ignore[arg-type]
    launcher_processes.FrontendProcess(cfg).ready()
    triton_urls: list[str] = []
    monkeypatch.setattr(launcher_tritonserver, "_http_ok", lambda url: triton_urls.append(url) or True)
    launcher_processes.TritonProcess(cfg, control_key="k").ready()
    base = cfg.frontend_base
    assert all(u.startswith(base) for u in urls), urls
    return urls[0][len(base):], urls[1][len(base):], [re.sub(r"^http://[^/]+", "", u) for u in triton_urls]


def make_serve_commands() -> list[list[str]]:
    """The commands of `make serve` (make -n), with the pod's build folder."""
    out = subprocess.run(["make", "-n", "serve", "PY=python", "BUILD=/workspace/build"], cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    commands = [line.split() for line in out.splitlines()  # (the venv's install steps may show up too)
                if line.startswith(("python -m build_engine ", "python -m launcher "))]
    assert [c[:3] for c in commands] == [["python", "-m", "build_engine"], ["python", "-m", "launcher"]], out
    return commands


def restricted_argv(key: str) -> list[str]:
    """The launcher's tritonserver options that put Triton's control APIs, HTTP and gRPC, behind `key`."""
    server = launcher_tritonserver.TritonServer(Path("/r"), 8000, 8001, 8002, log_file=Path("/l"),
                                                work_dir=Path("/w"), control_key=key)
    server._install = launcher_tritonserver.TritonInstall(Path("/bin/tritonserver"), Path("/b"))  # not looked up
    options = restricted_options(server.command())
    assert len(options) == 2 and all(o.endswith(f"triton-control-key={key}") for o in options), options
    return options


def restricted_options(argv: list[str]) -> list[str]:
    return sorted(a for a in argv if a.startswith(("--http-restricted-api", "--grpc-restricted-protocol")))


def load_script(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_triton_cpu() -> Any:
    return load_script(K8S / "overlays" / "cpu" / "triton_cpu.py")


# ----- every overlay -------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_one_frontend_pod_that_hides_triton(overlay: str) -> None:
    docs = render(overlay)
    pod = server_pod(docs)
    frontend, triton = container(pod, "frontend"), container(pod, "triton")
    assert triton.get("restartPolicy") == "Always", "Triton runs as a sidecar: up before the frontend, down after"
    # Triton's HTTP, gRPC and metrics all stay on the pod's loopback; the frontend's port is the only one.
    assert ports_of(frontend) == {"http": 9000}
    assert ports_of(triton) == {}
    assert env_of(frontend)["TRITON_GRPC_URL"].startswith("127.0.0.1:")
    # The engine's gauges leave the pod on the frontend's /metrics, fetched from Triton on loopback.
    triton_env = env_of(triton)
    assert env_of(frontend)["TRITON_METRICS_URL"] == f"http://127.0.0.1:{triton_env['TRITON_METRICS_PORT']}/metrics"
    if "launcher.mpi" in " ".join(triton["command"]):
        # launcher.mpi binds all interfaces unless TRITON_ADDRESS says otherwise.
        assert triton_env.get("TRITON_ADDRESS") == "127.0.0.1"
    else:
        assert "TRITON_ADDRESS" not in triton_env or triton_env["TRITON_ADDRESS"] == "127.0.0.1"
    # The one Service exposes the frontend only.
    service = resource(docs, "Service", "tritonllm")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    # No secret in a manifest: API keys come from a file mounted from the Secret the user creates.
    assert env_of(frontend)["API_KEYS_FILE"].startswith("/etc/tritonllm/api-keys/")
    assert "API_KEYS" not in env_of(frontend)
    secrets = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
    assert "tritonllm-api-keys" in secrets
    assert not [d for d in docs if d["kind"] == "Secret"]
    # Scale-down drains: the grace period covers preStop and the frontend's SHUTDOWN_GRACE_S, with room.
    pre_stop = frontend["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["spec"]["terminationGracePeriodSeconds"] > int(pre_stop[1]) + float(env_of(frontend)["SHUTDOWN_GRACE_S"]) + 15


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_container_exposes_tritons_ports_or_binds_them_to_all_interfaces(overlay: str) -> None:
    docs = render(overlay)
    containers = all_containers(docs)
    assert {"frontend", "triton"} <= {c["name"] for c in containers}
    for c in containers:
        exposed = {p["containerPort"] for p in c.get("ports", [])} & TRITON_PORTS
        assert not exposed, f"{overlay}: container {c['name']} declares Triton's port(s) {sorted(exposed)}"
        # Every string of its command line, shell one-liners included.
        words = [w for arg in c.get("command", []) + c.get("args", []) for w in str(arg).split()]
        for word in words:
            match = re.match(r"--(metrics|http|grpc)-address(?:=(.*))?$", word)
            if match:
                assert match.group(2) == "127.0.0.1", f"{overlay}: container {c['name']} binds {word!r}"
        for name, value in env_of(c).items():
            if name == "TRITON_ADDRESS":
                assert value == "127.0.0.1", f"{overlay}: container {c['name']}: TRITON_ADDRESS={value}"
    # Nor does any Service or NetworkPolicy name them.
    for doc in docs:
        if doc["kind"] == "Service":
            ports = {p["port"] for p in doc["spec"]["ports"]} | {p.get("targetPort") for p in doc["spec"]["ports"]}
            assert not ports & TRITON_PORTS, f"{overlay}: Service {doc['metadata']['name']}: {ports}"
        if doc["kind"] == "NetworkPolicy":
            ports = {p["port"] for rule in doc["spec"].get("ingress", []) for p in rule.get("ports", [])}
            assert not ports & TRITON_PORTS, f"{overlay}: NetworkPolicy {doc['metadata']['name']}: {ports}"


def test_tritons_ports_are_the_launchers(launcher_config: Config) -> None:
    """TRITON_PORTS are the launcher's defaults (the ports the pods use), so the check above covers them."""
    cfg = launcher_config
    assert {cfg.http_port, cfg.grpc_port, cfg.metrics_port} == TRITON_PORTS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_inference_pool_selects_the_server_pods_through_the_frontend(overlay: str) -> None:
    docs = render(overlay)
    pod = server_pod(docs)
    pool = resource(docs, "InferencePool", "tritonllm")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    labels = pod["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports_of(container(pod, "frontend"))["http"]]
    # The picker it names exists, on that port, and scrapes the frontend's port of these pods (its
    # /metrics, which carries Triton's metrics too).
    ref = pool["spec"]["endpointPickerRef"]
    epp_service = resource(docs, "Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in epp_service["spec"]["ports"]]
    epp = resource(docs, "Deployment", ref["name"])
    assert epp_service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--model-server-metrics-port={ports_of(container(pod, 'frontend'))['http']}" in args
    assert [a for a in args if a.startswith("--model-server-metrics-port=")] == ["--model-server-metrics-port=9000"]
    source = next(p for p in epp_config(docs)["plugins"] if p["type"] == "metrics-data-source")
    assert source["parameters"]["path"] == "/metrics"
    assert "--pool-name=tritonllm" in args
    route = resource(docs, "HTTPRoute", "tritonllm")
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == "tritonllm"
    # The frontend's port is open to all; the picker and Prometheus have a rule of their own for it (kept
    # when the first rule's `from` is narrowed to the gateway). Nothing else is open.
    policy = resource(docs, "NetworkPolicy", "tritonllm-server")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    open_rule, metrics_rule = policy["spec"]["ingress"]
    assert "from" not in open_rule and [p["port"] for p in open_rule["ports"]] == [9000]
    assert [p["port"] for p in metrics_rule["ports"]] == [9000]
    assert {"podSelector": {"matchLabels": epp["spec"]["selector"]["matchLabels"]}} in metrics_rule["from"]
    assert {"namespaceSelector": {"matchLabels": {"tritonllm.io/monitoring": "true"}}} in metrics_rule["from"]


def test_prometheus_scrapes_the_frontends_metrics_only() -> None:
    docs = tuple(yaml.safe_load_all((K8S / "monitoring" / "podmonitor.yaml").read_text()))
    monitor = resource(docs, "PodMonitor", "tritonllm")
    pod = server_pod(render("cpu"))
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]] == [("http", "/metrics")]
    assert ports_of(container(pod, "frontend"))["http"] == 9000


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaler_and_budget_target_the_servers(overlay: str) -> None:
    docs = render(overlay)
    hpa = resource(docs, "HorizontalPodAutoscaler", "tritonllm")
    target = hpa["spec"]["scaleTargetRef"]
    scaled = resource(docs, target["kind"], target["name"])
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert "replicas" not in scaled["spec"], "the HPA owns the replica count; re-applying must not reset it"
    metrics = autoscaler_metrics(docs)
    assert "tritonllm_requests_queued" in metrics and len(metrics) == 2
    pdb = resource(docs, "PodDisruptionBudget", "tritonllm")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= server_pod(docs)["metadata"]["labels"].items()


def test_gpu_overlays_read_the_protocol_names_of_triton_tensorrt_llm() -> None:
    """The names cannot be scraped without a GPU; they must at least be the extension's own."""
    for overlay in ("gpu", "tp", "multinode"):
        docs = render(overlay)
        specs = {field: f"{name}{{{','.join(f'{k}={v}' for k, v in labels.items())}}}"
                 for field, (name, labels) in picker_metrics(docs).items()}
        engine_side = {k: v for k, v in PROTOCOL_TRTLLM.items() if k != "queuedRequestsSpec"}
        assert {k: specs[k] for k in engine_side} == engine_side
        # The queue is the frontend's sum, whose engine part is the protocol's waiting series.
        assert picker_metrics(docs)["queuedRequestsSpec"] == ("tritonllm_requests_waiting", {})
        assert parse_spec(PROTOCOL_TRTLLM["queuedRequestsSpec"]) in ENGINE_WAITING
        assert autoscaler_metrics(docs)["trtllm_requests_waiting"] == ("nv_trt_llm_request_metrics",
                                                                       {"request_type": "waiting"})


def test_tp_overlay_gives_triton_the_gpus_the_engine_is_built_for() -> None:
    docs = render("tp")
    job = resource(docs, "Job", "engine-build")["spec"]["template"]["spec"]["containers"][0]
    tp_size = env_of(job)["TP_SIZE"]
    assert int(tp_size) > 1
    triton = container(server_pod(docs), "triton")
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == tp_size
    assert job["resources"]["limits"]["nvidia.com/gpu"] == tp_size


def test_multinode_engine_is_built_for_the_gpus_per_pod_it_runs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Audit round 3 R8: TensorRT-LLM places rank r on GPU r % gpus_per_node (WorldConfig::mpi), gpus_per_node
    being the engine's (trtllm-build --gpus_per_node): the engine Job builds with the leader's GPUs per pod."""
    from build_engine.__main__ import parse_args

    docs = render("multinode")
    job = resource(docs, "Job", "engine-build")["spec"]["template"]["spec"]["containers"][0]
    leader_gpus = env_of(container(server_pod(docs), "triton"))["MPI_LWS_GPUS_PER_POD"]
    assert env_of(job)["MPI_LWS_GPUS_PER_POD"] == leader_gpus
    monkeypatch.setenv("MPI_LWS_GPUS_PER_POD", "4")  # what the Job's build_engine (build-engine.sh) then passes
    request = parse_args(["--backend", "trtllm", "--model", "/m", "--tp-size", "4", "--pp-size", "2"])[0]
    assert request.gpus_per_node == 4
    monkeypatch.delenv("MPI_LWS_GPUS_PER_POD")
    assert parse_args(["--backend", "trtllm", "--model", "/m"])[0].gpus_per_node == 8  # trtllm-build's default


def lws_template(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return resource(docs, "LeaderWorkerSet", "tritonllm")["spec"]["leaderWorkerTemplate"]


def test_multinode_overlay_spreads_the_engine_over_the_group() -> None:
    """TP within a pod (node), PP across the group's pods: the engine Job's TP x PP = the group's GPUs."""
    docs = render("multinode")
    assert not [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tritonllm"]
    template = lws_template(docs)
    leader_triton = container(server_pod(docs), "triton")
    [worker] = template["workerTemplate"]["spec"]["containers"]
    gpus_per_pod = int(leader_triton["resources"]["limits"]["nvidia.com/gpu"])
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == leader_triton["resources"]["limits"]["nvidia.com/gpu"]
    job = resource(docs, "Job", "engine-build")["spec"]["template"]["spec"]["containers"][0]
    tp_size, pp_size = int(env_of(job)["TP_SIZE"]), int(env_of(job)["PP_SIZE"])
    assert tp_size * pp_size == template["size"] * gpus_per_pod, "one rank per GPU of the group"
    assert tp_size <= gpus_per_pod, "a tensor-parallel group's all-reduces stay inside one node"
    assert (tp_size, pp_size) == (gpus_per_pod, template["size"]) == (8, 2)
    assert int(job["resources"]["limits"]["nvidia.com/gpu"]) == tp_size  # trtllm-build: a worker per GPU
    assert env_of(leader_triton)["MPI_LWS_GPUS_PER_POD"] == str(gpus_per_pod)
    assert "exec python -m launcher.mpi " in leader_triton["command"][-1]
    worker_labels = template["workerTemplate"]["metadata"]["labels"]
    assert worker_labels["app.kubernetes.io/component"] != "server", "workers serve nothing: not in the pool"
    # The engine Job passes PP_SIZE on (build-engine.sh) and the key's record checks it (engine_key.py).
    script = (K8S / "base" / "scripts" / "build-engine.sh").read_text()
    assert '--pp-size "$pp"' in script and 'pp=${PP_SIZE:-1}' in script


def test_multinode_runs_no_ssh_and_its_workers_only_sleep() -> None:
    docs = render("multinode")
    for c in all_containers(docs):
        words = [w for arg in c.get("command", []) + c.get("args", []) for w in str(arg).split()]
        assert not [w for w in words if re.search(r"(^|/)sshd?$|ssh-keygen|authorized_keys", w)], c["name"]
        assert not [p for p in c.get("ports", []) if p["containerPort"] in (22, 2222)], c["name"]
        assert not [e for e in c.get("env", []) if e["name"].startswith("OMPI_MCA_plm_rsh")], c["name"]
    for spec in pod_specs(resource(docs, "LeaderWorkerSet", "tritonllm")):
        # No SSH keys: the only Secrets are the frontend's (API keys, reasoning keys, the store's password).
        assert {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v} <= {
            "tritonllm-api-keys", "tritonllm-reasoning-keys", "tritonllm-responses-db"}
    # The launch agent calls kubectl, never ssh; the image installs no SSH server.
    agent = [line.split("#")[0] for line in (K8S / "overlays" / "multinode" / "kubessh.sh").read_text().splitlines()]
    assert not [line for line in agent if re.search(r"\bssh\b|sshd", line)]
    assert re.search(r"^exec kubectl exec ", "\n".join(agent), re.M)
    assert "openssh" not in (REPO / "docker" / "Dockerfile.trtllm").read_text()
    worker = lws_template(docs)["workerTemplate"]["spec"]
    assert not worker.get("initContainers")
    [rank_host] = worker["containers"]
    assert rank_host["name"] == "rank-host"
    assert rank_host["command"] == ["sleep", "infinity"] and "args" not in rank_host
    assert not rank_host.get("ports") and "livenessProbe" not in rank_host and "readinessProbe" not in rank_host
    assert worker["automountServiceAccountToken"] is False and "serviceAccountName" not in worker
    # The ranks read the engine from the worker's own mount of the volume; nothing else is mounted.
    assert {m["mountPath"] for m in rank_host["volumeMounts"]} == {"/cache", "/tmp", "/dev/shm"}
    assert rank_host["securityContext"]["runAsUser"] == 10001 and rank_host["securityContext"]["readOnlyRootFilesystem"]


def test_multinode_leader_has_exactly_the_rbac_to_exec_into_its_workers() -> None:
    docs = render("multinode")
    pod = server_pod(docs)["spec"]
    account = pod["serviceAccountName"]
    resource(docs, "ServiceAccount", account)
    [binding] = [d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
                 and any(s["name"] == account for s in d["subjects"])]
    assert binding["kind"] == "RoleBinding" and binding["metadata"]["namespace"] == "tritonllm"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "tritonllm"}]
    assert binding["roleRef"]["kind"] == "Role"
    role = resource(docs, "Role", binding["roleRef"]["name"])
    rules = sorted((tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"])
    assert rules == [(("",), ("pods",), ("get",)), (("",), ("pods/exec",), ("create", "get"))]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    # The token: not mounted into every container, only into Triton's (the frontend faces the clients).
    assert pod["automountServiceAccountToken"] is False
    [volume] = [v for v in pod["volumes"] if "projected" in v]
    assert {"serviceAccountToken"} < {key for source in volume["projected"]["sources"] for key in source}
    mounted = [(c["name"], m) for c in all_containers(docs) for m in c.get("volumeMounts", [])
               if m["name"] == volume["name"]]
    assert mounted == [("triton", {"name": volume["name"], "readOnly": True,
                                   "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"})]
    # No other overlay grants exec.
    for overlay in ("cpu", "gpu", "tp"):
        for d in render(overlay):
            if d["kind"] == "Role":
                assert "pods/exec" not in [r for rule in d["rules"] for r in rule["resources"]], overlay


def test_multinode_mpirun_gets_the_exec_agent_and_forwards_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The leader's Triton environment, as launcher.mpi turns it into mpirun's command in an LWS pod."""
    import launcher.mpi as launcher_mpi

    docs = render("multinode")
    triton = container(server_pod(docs), "triton")
    env = env_of(triton)
    assert env["MPIRUN"] == "/opt/hpcx/ompi/bin/mpirun", "absolute: the remote daemons come from its prefix"
    assert env["MPI_RSH_AGENT"] == "/bin/sh /scripts/kubessh.sh"
    assert {"/scripts", "/tmp"} <= {m["mountPath"] for m in triton["volumeMounts"]}
    scripts = next(v["configMap"]["name"] for v in server_pod(docs)["spec"]["volumes"] if v["name"] == "scripts")
    assert resource(docs, "ConfigMap", scripts)["data"]["kubessh.sh"] == \
        (K8S / "overlays" / "multinode" / "kubessh.sh").read_text()
    assert {"PATH", "LD_LIBRARY_PATH"} <= set(env["MPI_EXPORT"].split())
    template = lws_template(docs)
    job = resource(docs, "Job", "engine-build")["spec"]["template"]["spec"]["containers"][0]
    tp_size, pp_size = int(env_of(job)["TP_SIZE"]), int(env_of(job)["PP_SIZE"])
    engine = {"world_size": tp_size * pp_size, "tp_size": tp_size, "pp_size": pp_size}
    monkeypatch.setattr(launcher_mpi, "check_model_repository", lambda repo: engine)
    pod_env = {**env, "LWS_LEADER_ADDRESS": "tritonllm-0.tritonllm.tritonllm",
               "LWS_GROUP_SIZE": str(template["size"]), "PATH": "/opt/tritonllm/bin:/usr/bin",
               "LD_LIBRARY_PATH": "/opt/hpcx/ompi/lib"}
    for name in ("MPI_HOSTS", "NCCL_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in pod_env.items():
        monkeypatch.setenv(name, value)
    assert launcher_mpi.main(["--model-repository", "/cache/k/model_repository", "--print"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    gpus = env["MPI_LWS_GPUS_PER_POD"]
    assert argv[:argv.index("-n")] == [
        "/opt/hpcx/ompi/bin/mpirun", "--allow-run-as-root", "--host", f"tritonllm-0:{gpus},tritonllm-0-1:{gpus}",
        "-mca", "plm_rsh_agent", "/bin/sh /scripts/kubessh.sh", "-mca", "plm_rsh_no_tree_spawn", "1",
        "-x", "PATH", "-x", "LD_LIBRARY_PATH", "-x", "HOME"]
    ranks = " ".join(argv).split(" : ")
    assert len(ranks) == tp_size * pp_size
    assert "--allow-http=false" not in ranks[0] and "--http-address=127.0.0.1" in ranks[0]
    assert all("--allow-http=false --allow-grpc=false --allow-metrics=false" in rank for rank in ranks[1:])


def test_kubessh_waits_for_the_pod_then_execs_the_command_in_its_rank_host(tmp_path: Path) -> None:
    """kubessh.sh with a stand-in kubectl: not ready, then ready; then `kubectl exec` with mpirun's words."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    (bin_dir / "kubectl").write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for a in "$@"; do printf '%s\\n' "$a"; done >> {log}
        echo --- >> {log}
        if [ "$1" = get ]; then
          n=$(grep -c '^get$' {log})
          [ "$n" -ge 2 ] && printf True || printf False
        fi
        if [ "$1" = exec ]; then shift 5; "$@"; fi
        """))
    (bin_dir / "kubectl").chmod(0o755)
    (bin_dir / "sleep").write_text("#!/bin/sh\n")
    (bin_dir / "sleep").chmod(0o755)
    script = K8S / "overlays" / "multinode" / "kubessh.sh"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    command = ["PATH=/opt/hpcx/ompi/bin:$PATH", ";", "export", "PATH", ";", "echo", '"uri;tcp://10.0.0.1:1"']
    run = subprocess.run(["/bin/sh", str(script), "tritonllm-0-1", *command], env=env, capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "uri;tcp://10.0.0.1:1\n", "the words are run by a shell on the far side, as over ssh"
    calls = [c.strip("\n").split("\n") for c in log.read_text().split("---\n") if c.strip()]
    assert [c[:3] for c in calls] == [["get", "pod", "tritonllm-0-1"]] * 2 + [["exec", "tritonllm-0-1", "-c"]]
    assert calls[-1] == ["exec", "tritonllm-0-1", "-c", "rank-host", "--", "/bin/sh", "-c", " ".join(command)]
    # A pod that never gets ready: give up after KUBESSH_WAIT_S.
    log.write_text("")
    (bin_dir / "kubectl").write_text("#!/bin/sh\nprintf False\n")
    run = subprocess.run(["/bin/sh", str(script), "p", "true"], env={**env, "KUBESSH_WAIT_S": "10"},
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 1 and "not ready after 10 s" in run.stderr


def test_multinode_network_policies_let_the_group_talk() -> None:
    """mpirun's daemons and NCCL use ports chosen at run time between the group's pods, both ways."""
    docs = render("multinode")
    workers = resource(docs, "NetworkPolicy", "tritonllm-workers")["spec"]
    assert workers["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "server-worker"
    [rule] = workers["ingress"]
    assert "ports" not in rule
    [selector] = rule["from"]
    expressions = {e["key"]: set(e["values"]) for e in selector["podSelector"]["matchExpressions"]}
    assert expressions == {"app.kubernetes.io/name": {"tritonllm"},
                           "app.kubernetes.io/component": {"server", "server-worker"}}
    leaders = resource(docs, "NetworkPolicy", "tritonllm-leaders-from-workers")["spec"]
    assert leaders["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "server"
    [rule] = leaders["ingress"]
    assert "ports" not in rule
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "tritonllm",
                                                              "app.kubernetes.io/component": "server-worker"}}}]
    # Egress stays open (mpirun -> workers, kubectl -> API server): no policy restricts it.
    assert not [d for d in docs if d["kind"] == "NetworkPolicy" and "Egress" in d["spec"]["policyTypes"]]


def test_the_image_has_what_the_multinode_pods_run() -> None:
    """docker/Dockerfile.trtllm: a passwd entry for the pods' uid (mpirun refuses an unknown one), kubectl
    pinned by version and checksum, and HPC-X's mpirun where MPIRUN says."""
    dockerfile = (REPO / "docker" / "Dockerfile.trtllm").read_text()
    uid = container(server_pod(render("multinode")), "triton")["securityContext"]["runAsUser"]
    assert re.search(rf"useradd [^\n]*--uid {uid} ", dockerfile)
    assert re.search(r"ARG KUBECTL_VERSION=v\d+\.\d+\.\d+\n", dockerfile)
    assert re.search(r"ARG KUBECTL_SHA256_AMD64=[0-9a-f]{64}\n", dockerfile)
    assert "sha256sum -c -" in dockerfile and "install -m 0755 /tmp/kubectl /usr/local/bin/kubectl" in dockerfile
    assert "test -x /opt/hpcx/ompi/bin/mpirun" in dockerfile


# ----- the CPU overlay against `make serve` --------------------------------------------------------------
def test_cpu_pod_has_the_ports_and_environment_of_make_serve(launcher_config: Config,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = launcher_config
    pod = server_pod(render("cpu"))
    frontend, triton = container(pod, "frontend"), container(pod, "triton")
    expected = launcher_frontend_env(cfg, monkeypatch)
    got = env_of(frontend)
    # TRITON_METRICS_URL: the frontend's /metrics carries Triton's, as under `make serve`.
    assert "TRITON_METRICS_URL" in expected, "the launcher no longer passes TRITON_METRICS_URL"
    for name in ("FRONTEND_HOST", "FRONTEND_PORT", "TRITON_GRPC_URL", "TRITON_HTTP_URL", "TRITON_METRICS_URL",
                 "ENGINE_MODEL"):
        assert got[name] == expected[name], name
    assert float(got["SHUTDOWN_GRACE_S"]) == cfg.shutdown_grace_s
    assert ports_of(frontend)["http"] == cfg.frontend_port
    # Triton reads the launcher's variables with the launcher's code (triton_cpu.py): same values here.
    triton_env = env_of(triton)
    assert int(triton_env["TRITON_HTTP_PORT"]) == cfg.http_port
    assert int(triton_env["TRITON_GRPC_PORT"]) == cfg.grpc_port
    assert int(triton_env["TRITON_METRICS_PORT"]) == cfg.metrics_port
    assert ports_of(triton) == {}, "Triton's ports stay inside the pod"
    assert triton_env["ENGINE_MODEL"] == cfg.engine_model


def test_cpu_pod_probes_what_make_serve_probes(launcher_config: Config,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = launcher_config
    ready_path, live_path, triton_paths = launcher_probe_paths(cfg, monkeypatch)
    routes = {route.path for route in router.routes}
    assert {ready_path, live_path} <= routes
    pod = server_pod(render("cpu"))
    frontend, triton = container(pod, "frontend"), container(pod, "triton")
    assert frontend["readinessProbe"]["httpGet"] == {"path": ready_path, "port": "http"}
    assert frontend["livenessProbe"]["httpGet"] == {"path": live_path, "port": "http"}
    assert frontend["startupProbe"]["httpGet"]["path"] == live_path
    # Triton: ready when the launcher would start the frontend (server and engine model ready), within the
    # launcher's TRITON_READY_TIMEOUT.
    startup = triton["startupProbe"]
    script = startup["exec"]["command"][-1]
    for path in triton_paths:
        assert path.replace(f"/{cfg.engine_model}/", '/" + os.environ["ENGINE_MODEL"] + "/') in script, path
    assert 'os.environ["TRITON_HTTP_PORT"]' in script and "127.0.0.1" in script
    assert startup["periodSeconds"] * startup["failureThreshold"] >= cfg.triton_ready_timeout_s


def test_cpu_pod_runs_the_commands_of_make_serve(tmp_path: Path, launcher_config: Config) -> None:
    build_step, serve_step = make_serve_commands()
    pod = server_pod(render("cpu"))
    assert container(pod, "build-engine")["command"] == build_step
    triton = container(pod, "triton")
    assert triton["command"][:2] == ["python", "/scripts/triton_cpu.py"]
    assert triton["command"][2:] == serve_step[4:], "the launcher's serve arguments (repository, work dir)"
    # The script the pod runs is this file, from the generated ConfigMap.
    docs = render("cpu")
    mount = next(m for m in triton["volumeMounts"] if m["mountPath"] == "/scripts")
    configmap_name = next(v["configMap"]["name"] for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    configmap = resource(docs, "ConfigMap", configmap_name)
    assert configmap["data"]["triton_cpu.py"] == (K8S / "overlays" / "cpu" / "triton_cpu.py").read_text()


def test_triton_cpu_execs_the_launchers_tritonserver_with_every_port_on_loopback(
        tmp_path: Path, launcher_config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = launcher_config
    key_file = tmp_path / "control-key"
    key_file.write_text("k" * 64)
    monkeypatch.setenv("TRITON_CONTROL_KEY_FILE", str(key_file))  # as the pod sets it (written at pod start)
    argv, env = load_triton_cpu().command(["--model-repository", str(tmp_path / "repo"), "--work-dir", str(tmp_path)])
    launcher_argv = launcher_tritonserver.TritonServer(
        tmp_path / "repo", cfg.http_port, cfg.grpc_port, cfg.metrics_port, log_file=tmp_path / "log",
        work_dir=tmp_path, model_name=cfg.engine_model, control_key="k" * 64).command()
    assert argv == launcher_argv, "the launcher's command, with the pod's control key, nothing added"
    assert restricted_options(argv) == restricted_argv("k" * 64), argv
    addresses = [a for a in argv if re.match(r"--(http|grpc|metrics)-address", a)]
    assert sorted(addresses) == ["--grpc-address=127.0.0.1", "--http-address=127.0.0.1",
                                 "--metrics-address=127.0.0.1"]
    assert f"--metrics-port={cfg.metrics_port}" in argv
    assert Path(argv[0]).is_file() and "LD_LIBRARY_PATH" in env


def test_cpu_overlay_reads_cpu_engine_metrics() -> None:
    docs = render("cpu")
    names = {name for name, _ in picker_metrics(docs).values()} | {n for n, _ in autoscaler_metrics(docs).values()}
    assert names and not [n for n in names if n.startswith("nv_trt_llm")], names
    assert picker_metrics(docs)["kvUsageSpec"][0] == "cpu_engine_kv_cache_usage_ratio"
    # The picker's queue: the frontend's sum, whose engine part is the gauge the HPA reads for the engine.
    assert picker_metrics(docs)["queuedRequestsSpec"] == ("tritonllm_requests_waiting", {})
    engine_queue = autoscaler_metrics(docs)["cpu_engine_requests_waiting"]
    assert (engine_queue[0], {}) in ENGINE_WAITING


# ----- Triton's liveness: the engine model, not the process ----------------------------------------------
class ProbeTarget:
    """Triton's HTTP port as a probe sees it: /v2/health/live always 200; the engine model's ready route 200
    while `model_ready`, else 400 (as after the model unloaded itself)."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.model_ready = True
        target = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                ok = self.path in ("/v2/health/live", "/v2/health/ready") or (
                    self.path == "/v2/models/tensorrt_llm/ready" and target.model_ready)
                self.send_response(200 if ok else 400)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def run(self, probe: dict[str, Any], env: dict[str, str]) -> int:
        command = probe["exec"]["command"]
        assert command[:2] == ["python", "-c"], command
        probe_env = {**os.environ, **env, "TRITON_HTTP_PORT": str(self.server.server_address[1])}
        return subprocess.run([sys.executable, "-c", command[2]], env=probe_env, capture_output=True,
                              timeout=30).returncode

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_triton_is_alive_while_the_engine_model_is_ready(overlay: str,
                                                         launcher_config: Config) -> None:
    pod = server_pod(render(overlay))
    triton, frontend = container(pod, "triton"), container(pod, "frontend")
    # The model the probes ask for is the one the frontend serves (ENGINE_MODEL of both containers).
    assert env_of(triton)["ENGINE_MODEL"] == env_of(frontend)["ENGINE_MODEL"] == launcher_config.engine_model
    live, startup = triton["livenessProbe"], triton["startupProbe"]
    # What follows the engine model's ready route; the CPU overlay's liveness is launcher.engine_health
    # instead (its stub can die with the model still READY), tested against the real Triton in
    # tests/integration/test_self_healing.py, on the container's own ports.
    http_probes = [startup] if overlay == "cpu" else [live, startup]
    if overlay == "cpu":
        assert live["exec"]["command"] == ["python", "-m", "launcher.engine_health"]
        assert {"TRITON_GRPC_PORT", "ENGINE_MODEL"} <= set(env_of(triton))
    target = ProbeTarget()
    try:
        assert [target.run(probe, env_of(triton)) for probe in http_probes] == [0] * len(http_probes)
        target.model_ready = False  # unloaded itself (engine thread dead) or its stub died: the process lives on
        assert 0 not in [target.run(probe, env_of(triton)) for probe in http_probes], \
            "liveness must fail when the engine model is not ready"
    finally:
        target.close()
    assert "/v2/health/live" not in live["exec"]["command"][-1]
    # Not ready for a minute before a restart: far longer than any blip, and a rollout never makes the model
    # unready by name (frontend/models/rollout.py loads the new version beside the live one). The startup probe,
    # which holds the liveness probe off until it passes, covers an engine load (the launcher's timeout).
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    assert live["timeoutSeconds"] > 5  # the script's own timeout (engine_health: 5 s a probe, plus the connect)
    assert startup["periodSeconds"] * startup["failureThreshold"] >= launcher_config.triton_ready_timeout_s


# ----- the engine of a pod: its ENGINE_KEY, never `current` ------------------------------------------------
def configmap_ref(docs: tuple[dict[str, Any], ...], c: dict[str, Any], name: str) -> tuple[str, str]:
    """The rendered ConfigMap and key an environment variable of `c` comes from; that ConfigMap exists."""
    [ref] = [e["valueFrom"]["configMapKeyRef"] for e in c.get("env", []) if e["name"] == name]
    return ref["name"], resource(docs, "ConfigMap", ref["name"])["data"][ref["key"]]


@pytest.mark.parametrize("overlay", ["gpu", "tp", "multinode"])
def test_pods_serve_the_engine_of_their_own_engine_key(overlay: str) -> None:
    docs = render(overlay)
    pod = server_pod(docs)
    job = resource(docs, "Job", "engine-build")["spec"]["template"]["spec"]["containers"][0]
    built = configmap_ref(docs, job, "ENGINE_KEY")
    wait = container(pod, "wait-engine")
    triton = container(pod, "triton")
    # One key for the Job and the pod (one generated ConfigMap, whose hashed name is in the pod template: a
    # new key is a new template, i.e. a rollout of the server pods, and nothing else switches them).
    assert configmap_ref(docs, wait, "ENGINE_KEY") == built
    assert configmap_ref(docs, triton, "ENGINE_KEY") == built
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", built[1])
    assert '--model-repository "/cache/$ENGINE_KEY/model_repository"' in triton["command"][-1]
    # Nothing in the pods follows a link that a re-run of the Job moves.
    scripts = [(K8S / "base" / "scripts" / name).read_text() for name in ("build-engine.sh", "wait-engine.sh")]
    for text in [yaml.safe_dump(pod), *scripts]:
        assert "/cache/current" not in text and "current.tmp" not in text
    assert 'dir="/cache/$ENGINE_KEY"' in scripts[1]
    # The frontend's tokenizer is the key's too: Triton's config names /cache/<key>/hf (the Job builds from that
    # snapshot), which the frontend mounts read-only; the checkpoint volume (changed in place to build the next
    # key) is mounted by the Job only.
    mounts = {m["mountPath"]: m for m in container(pod, "frontend")["volumeMounts"]}
    assert mounts["/cache"]["name"] == "engine-cache" and mounts["/cache"]["readOnly"] is True
    assert '--model "$dir/hf"' in scripts[0]
    for spec in pod_specs(resource(docs, server_kind(docs), "tritonllm")):
        assert "models" not in {v["name"] for v in spec.get("volumes", [])}
    assert {"name": "models", "mountPath": "/models/hf", "readOnly": True} in job["volumeMounts"]


def server_kind(docs: tuple[dict[str, Any], ...]) -> str:
    return "LeaderWorkerSet" if [d for d in docs if d["kind"] == "LeaderWorkerSet"] else "Deployment"


def test_a_new_engine_key_changes_the_pod_template(tmp_path: Path) -> None:
    """Setting ENGINE_KEY (here from an overlay of the gpu overlay) rolls the Deployment: its template changes."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp_path)],
        "configMapGenerator": [{"name": "tritonllm-engine", "behavior": "merge", "literals": ["ENGINE_KEY=engine-2"]}],
    }))
    out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], check=True, capture_output=True, text=True,
                         timeout=60).stdout
    docs = tuple(doc for doc in yaml.safe_load_all(out) if doc)
    before, after = server_pod(render("gpu")), server_pod(docs)
    assert configmap_ref(docs, container(after, "triton"), "ENGINE_KEY")[1] == "engine-2"
    assert before != after


def test_engine_key_refuses_to_rebuild_a_key_and_snapshots_the_checkpoint(tmp_path: Path) -> None:
    engine_key = load_script(K8S / "base" / "scripts" / "engine_key.py")
    checkpoint = tmp_path / "hf"
    (checkpoint / "original").mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "tokenizer.json").write_text('{"model": {}}')
    (checkpoint / "model.safetensors").write_bytes(b"\0" * 1024)
    (checkpoint / "original" / "consolidated.00.pth").write_bytes(b"\1" * 1024)
    key = tmp_path / "cache" / "engine-1"
    engine_key.snapshot(checkpoint, key / "hf")
    snap = key / "hf"
    assert not (snap / "tokenizer.json").is_symlink() and (snap / "tokenizer.json").read_text() == '{"model": {}}'
    assert (snap / "model.safetensors").is_symlink() and (snap / "original" / "consolidated.00.pth").is_symlink()
    assert os.readlink(snap / "model.safetensors") == str(checkpoint / "model.safetensors")
    # The Job compares the source's hash with the record's, which the build takes of the snapshot: the same.
    sha = checkpoint_sha256(checkpoint)
    assert checkpoint_sha256(snap) == sha
    assert engine_key.built(key, "1.1.0", "1", sha) == engine_key.NOT_BUILT
    (key / "engine").mkdir()
    (key / "engine" / "engine_config.json").write_text(json.dumps(
        {"tensorrt_llm_version": "1.1.0", "tp_size": 1, "checkpoint_sha256": sha}))
    assert engine_key.built(key, "1.1.0", "1", sha) == 0
    assert engine_key.built(key, "1.1.0", "1", "0" * 64) == 1  # another checkpoint under a built key
    assert engine_key.built(key, "1.2.0", "1", sha) == 1  # another image
    assert engine_key.built(key, "1.1.0", "2", sha) == 1  # another TP size
    assert engine_key.built(key, "1.1.0", "1", sha, "1") == 0  # no pp_size recorded: 1
    assert engine_key.built(key, "1.1.0", "1", sha, "2") == 1  # another PP size


# ----- Triton's control APIs: a key per pod, shared by Triton and the frontend only ------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tritons_control_key_is_made_per_pod_in_memory_and_shared_with_the_frontend_only(overlay: str) -> None:
    docs = render(overlay)
    pod = server_pod(docs)
    spec = pod["spec"]
    init_names = [c["name"] for c in spec["initContainers"]]
    maker, triton, frontend = (container(pod, n) for n in ("triton-control-key", "triton", "frontend"))
    # Made before Triton starts (init containers start in order; the frontend after all of them).
    assert init_names.index("triton-control-key") < init_names.index("triton") == len(init_names) - 1
    assert maker.get("restartPolicy") is None, "runs once, to completion"
    key_file = env_of(maker)["TRITON_CONTROL_KEY_FILE"]
    assert env_of(triton)["TRITON_CONTROL_KEY_FILE"] == env_of(frontend)["TRITON_CONTROL_KEY_FILE"] == key_file
    assert maker["command"] == ["python", "/scripts/triton_control_key.py"]
    # An in-memory volume of this pod: written by the maker, read-only for Triton and the frontend, mounted
    # by nothing else (not the picker, the Job, nor a multi-node worker).
    [volume] = [v for v in spec["volumes"] if v["name"] == "triton-control"]
    assert volume["emptyDir"]["medium"] == "Memory"
    for c in all_containers(docs):
        mounts = [m for m in c.get("volumeMounts", []) if m["name"] == "triton-control"]
        if c["name"] not in ("triton-control-key", "triton", "frontend"):
            assert not mounts, c["name"]
            continue
        assert [m["mountPath"] for m in mounts] == [os.path.dirname(key_file)], c["name"]
        assert mounts[0].get("readOnly", False) is (c["name"] != "triton-control-key"), c["name"]
    # Never a value in a manifest: no Secret, no environment variable holding it.
    assert not [d for d in docs if d["kind"] == "Secret"]
    for c in all_containers(docs):
        assert not [e for e in c.get("env", []) if "CONTROL_KEY" in e["name"] and e["name"] != "TRITON_CONTROL_KEY_FILE"]


def test_the_control_key_file_is_new_at_each_start_and_readable_by_its_owner_only(tmp_path: Path) -> None:
    maker = load_script(K8S / "base" / "scripts" / "triton_control_key.py")
    path = tmp_path / "key"
    maker.write_key(str(path))
    first = path.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    assert stat.S_IMODE(path.stat().st_mode) == 0o400
    (tmp_path / "key.new").write_text("left by an interrupted start")
    maker.write_key(str(path))  # the pod restarted: a new key replaces the old one
    assert path.read_text() != first and stat.S_IMODE(path.stat().st_mode) == 0o400
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key"]


@pytest.mark.parametrize("overlay", ["gpu", "tp", "multinode"])
def test_gpu_triton_starts_with_its_control_apis_behind_the_pods_key(overlay: str, tmp_path: Path) -> None:
    """Runs the Triton container's command with a `python` that prints its arguments: what launcher.mpi gets
    (it passes options it does not know on to tritonserver, every rank)."""
    triton = container(server_pod(render(overlay)), "triton")
    assert triton["command"][:2] == ["/bin/sh", "-c"]
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    (fake_bin / "python").chmod(0o755)
    key_file = tmp_path / "key"
    key_file.write_text("ab" * 32)
    env = {**env_of(triton), "PATH": f"{fake_bin}:/usr/bin:/bin", "ENGINE_KEY": "engine-7",
           "TRITON_CONTROL_KEY_FILE": str(key_file)}
    run = subprocess.run(triton["command"], env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    argv = run.stdout.splitlines()
    assert argv[:4] == ["-m", "launcher.mpi", "--model-repository", "/cache/engine-7/model_repository"]
    assert restricted_options(argv) == restricted_argv("ab" * 32)
    assert restricted_options(tritonserver_argv(2, "/r", extra_args=argv[4:])) == sorted(restricted_argv("ab" * 32) * 2)
    # No key, no Triton: an empty or missing file stops the container instead of serving the APIs open.
    key_file.write_text("")
    assert subprocess.run(triton["command"], env=env, capture_output=True, timeout=30).returncode != 0


# ----- the endpoint picker: how often, and which queue ---------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_endpoint_picker_scrapes_as_often_as_the_frontend_refreshes_tritons_metrics(overlay: str) -> None:
    docs = render(overlay)
    args = resource(docs, "Deployment", "tritonllm-endpoint-picker")["spec"]["template"]["spec"]["containers"][0]["args"]
    [interval] = [a.split("=", 1)[1] for a in args if a.startswith("--refresh-metrics-interval=")]
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s)", interval)
    assert match, interval
    seconds = float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)
    frontend_env = env_of(container(server_pod(docs), "frontend"))
    cache_s = float(frontend_env.get("TRITON_METRICS_CACHE_S", Settings.model_fields["triton_metrics_cache_s"].default))
    assert seconds == cache_s and 0.5 <= seconds < 2, "under the picker's 2 s staleness threshold"
    # The queue the picker routes on counts the frontend's admission queue too.
    assert picker_metrics(docs)["queuedRequestsSpec"] == ("tritonllm_requests_waiting", {})


# ----- the Responses store (components/postgresql) -------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_shares_one_postgresql_store_whose_password_is_a_secret_file(overlay: str) -> None:
    """Every overlay can run several frontend pods: they share PostgreSQL, never a file of their own; the
    password is a mounted Secret (never a literal, never a pod spec's env); tests/integration/
    test_deploy_contract.py starts the frontend so declared."""
    docs = render(overlay)
    frontend = container(server_pod(docs), "frontend")
    url = env_of(frontend)["RESPONSES_DB_URL"]
    match = re.fullmatch(r"postgresql://(\w+)@([\w-]+):(\d+)/(\w+)", url)
    assert match, f"{overlay}: RESPONSES_DB_URL {url!r} is not a PostgreSQL DSN without a password"
    service = resource(docs, "Service", match.group(2))
    assert int(match.group(3)) in {p["port"] for p in service["spec"]["ports"]}
    statefulset = resource(docs, "StatefulSet", "tritonllm-postgres")
    assert service["spec"]["selector"].items() <= statefulset["spec"]["template"]["metadata"]["labels"].items()
    postgres = statefulset["spec"]["template"]["spec"]["containers"][0]
    assert env_of(postgres)["POSTGRES_USER"] == match.group(1) and env_of(postgres)["POSTGRES_DB"] == match.group(4)
    # The password: a file from the Secret in both pods; no container anywhere takes a Secret through env.
    for c in all_containers(docs):
        assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in c.get("env", [])), c["name"]
    volumes = {v["name"]: v for v in server_pod(docs)["spec"]["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in frontend["volumeMounts"]}
    password_file = env_of(postgres)["POSTGRES_PASSWORD_FILE"]
    assert mounts[str(Path(password_file).parent)]["secret"]["secretName"] == "tritonllm-responses-db"
    # The frontend reads it itself (RESPONSES_DB_PASSWORD_FILE) and runs the image's own command.
    assert env_of(frontend)["RESPONSES_DB_PASSWORD_FILE"] == password_file
    assert "command" not in frontend and "args" not in frontend, f"{overlay}: the image's command, unwrapped"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_frontend_shares_the_reasoning_keys_from_a_secret_file(overlay: str) -> None:
    """Several workers per pod and several pods: sealed reasoning (encrypted_content) one process makes must
    open in every other, so all read one key file, the Secret `tritonllm-reasoning-keys` (key `keys`), mounted
    like the API keys (0440, the frontend's fsGroup); never an env value."""
    docs = render(overlay)
    pod = server_pod(docs)
    frontend = container(pod, "frontend")
    env = env_of(frontend)
    assert "RESPONSES_REASONING_KEYS" not in env
    path = Path(env["RESPONSES_REASONING_KEYS_FILE"])
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in frontend["volumeMounts"]}
    mount = mounts[str(path.parent)]
    assert mount.get("readOnly") is True
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == "tritonllm-reasoning-keys"
    assert secret.get("defaultMode") == 0o440
    assert [item["path"] for item in secret.get("items", [{"key": "keys", "path": "keys"}])
            if item["key"] == "keys"] == [path.name]
    fs_group = pod["spec"]["securityContext"]["fsGroup"]
    assert fs_group == frontend["securityContext"]["runAsGroup"], "the frontend reads the 0440 file by group"


def test_postgresql_pod_is_restricted_and_reachable_from_the_servers_only() -> None:
    docs = render("cpu")
    template = resource(docs, "StatefulSet", "tritonllm-postgres")["spec"]["template"]
    spec = template["spec"]
    (postgres,) = spec["containers"]
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] >= 10000
    assert postgres["securityContext"]["readOnlyRootFilesystem"] and not postgres["securityContext"]["allowPrivilegeEscalation"]
    assert re.fullmatch(r"postgres:\d+\.\d+-\w+(@sha256:[0-9a-f]{64})?", postgres["image"]), postgres["image"]
    writable = {m["mountPath"] for m in postgres["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/var/lib/postgresql/data", "/var/run/postgresql", "/tmp"}
    assert env_of(postgres)["PGDATA"].startswith("/var/lib/postgresql/data/")
    policy = resource(docs, "NetworkPolicy", "tritonllm-postgres")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= server_pod(docs)["metadata"]["labels"].items()
    assert rule["ports"] == [{"protocol": "TCP", "port": 5432}]

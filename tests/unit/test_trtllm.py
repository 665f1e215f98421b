"""TensorRT-LLM backend, as far as a machine without a GPU can check it.

The rendered TensorRT-LLM and CPU repositories must expose the same tensor interface; the build must plan
the exact convert/trtllm-build commands; an engine built by another TensorRT-LLM version must be refused
before tritonserver starts; the mpirun command line must match upstream's launcher.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from build_engine import trtllm
from build_engine.__main__ import main as build_main
from build_engine.demo_checkpoint import ensure_demo_checkpoint
from build_engine.pipeline import TEMPLATE_DIR, BuildRequest, build, existing_build
from build_engine.render import RenderError, render_repository
from build_engine.values import repository_values, static_values
from launcher import engine_check
from launcher.engine_check import EngineMismatchError, check_model_repository, check_trtllm_engine
from launcher.mpi import main as mpi_main
from launcher.mpi import tritonserver_argv

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = "/app/examples"
VERSION = "1.1.0"


# --- fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo checkpoint: LlamaForCausalLM, float32, 1024 positions, with a real tokenizer."""
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny")


def patched_checkpoint(source: Path, target: Path, **config: Any) -> Path:
    """A copy of ``source`` whose config.json is updated with ``config`` (weights are never loaded)."""
    shutil.copytree(source, target)
    data = json.loads((target / "config.json").read_text())
    data.update(config)
    (target / "config.json").write_text(json.dumps(data, indent=2))
    return target


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory: pytest.TempPathFactory, llama_checkpoint: Path) -> Path:
    return patched_checkpoint(
        llama_checkpoint,
        tmp_path_factory.mktemp("qwen") / "qwen2-tiny",
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        dtype="bfloat16",
    )


def engine_config_for(checkpoint: Path) -> dict[str, Any]:
    return {"checkpoint_dir": str(checkpoint), "max_batch_size": 8, "max_seq_len": 1024, "max_num_tokens": 256,
            "served_model_name": "m"}


def render(backend: str, checkpoint: Path, out: Path, engine_dir: Path) -> Path:
    values = repository_values(TEMPLATE_DIR, backend, engine_config_for(checkpoint), engine_dir)
    render_repository(TEMPLATE_DIR, values, out)
    return out


@pytest.fixture(scope="module")
def repositories(tmp_path_factory: pytest.TempPathFactory, llama_checkpoint: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("repos")
    return {
        backend: render(backend, llama_checkpoint, root / backend / "model_repository", root / backend / "engine")
        for backend in ("cpu", "trtllm")
    }


def parse(path: Path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> list[list[str]]:
    assert build_main(["--backend", "trtllm", "--dry-run", *args]) == 0
    captured = capsys.readouterr()
    return [shlex.split(line) for line in captured.out.splitlines()]


# --- rendered repositories ------------------------------------------------------------------------------
def tensor_signature(tensor: Any) -> tuple[Any, ...]:
    return (
        tensor.name,
        model_config_pb2.DataType.Name(tensor.data_type),
        tuple(tensor.dims),
        getattr(tensor, "optional", False),
        tensor.HasField("reshape"),
        tuple(tensor.reshape.shape),
        getattr(tensor, "allow_ragged_batch", False),
    )


def test_every_rendered_config_parses(repositories: dict[str, Path]) -> None:
    for backend, repository in repositories.items():
        configs = sorted(repository.glob("*/config.pbtxt"))
        assert {p.parent.name for p in configs} == {"ensemble", "preprocessing", "postprocessing", "tensorrt_llm"}
        for path in configs:
            assert "${" not in path.read_text(), path
            assert parse(path).name == path.parent.name, (backend, path)


def test_engine_interfaces_are_identical(repositories: dict[str, Path]) -> None:
    cpu = parse(repositories["cpu"] / "tensorrt_llm" / "config.pbtxt")
    gpu = parse(repositories["trtllm"] / "tensorrt_llm" / "config.pbtxt")
    assert (cpu.backend, gpu.backend) == ("python", "tensorrtllm")
    assert [tensor_signature(t) for t in gpu.input] == [tensor_signature(t) for t in cpu.input]
    assert [tensor_signature(t) for t in gpu.output] == [tensor_signature(t) for t in cpu.output]
    assert {"input_ids", "input_lengths", "request_output_len", "streaming", "stop"} <= {t.name for t in gpu.input}
    assert {"output_ids", "sequence_length"} <= {t.name for t in gpu.output}
    # Same batching and transaction policy too: only the backend and its parameter values differ.
    for config in (cpu, gpu):
        config.ClearField("backend")
        config.ClearField("parameters")
    assert cpu == gpu


def test_other_models_are_identical_for_both_backends(repositories: dict[str, Path]) -> None:
    for model in ("ensemble", "preprocessing", "postprocessing"):
        cpu = (repositories["cpu"] / model / "config.pbtxt").read_text()
        assert (repositories["trtllm"] / model / "config.pbtxt").read_text() == cpu, model


def test_trtllm_parameters(repositories: dict[str, Path], llama_checkpoint: Path) -> None:
    config = parse(repositories["trtllm"] / "tensorrt_llm" / "config.pbtxt")
    params = {key: value.string_value for key, value in config.parameters.items()}
    assert config.model_transaction_policy.decoupled is True
    assert params["gpt_model_path"] == str((repositories["trtllm"].parent / "engine").resolve())
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["exclude_input_in_output"] == "true"
    assert params["enable_kv_cache_reuse"] == "true"
    assert params["enable_chunked_context"] == "true"
    assert params["batch_scheduler_policy"] in ("guaranteed_no_evict", "max_utilization")
    assert 0 < float(params["kv_cache_free_gpu_mem_fraction"]) < 1
    assert params["max_seq_len"] == "1024"
    assert params["tokenizer_dir"] == str(llama_checkpoint.resolve())
    assert params["max_top_logprobs"] == "0"  # TensorRT-LLM returns no alternatives
    pre = parse(repositories["trtllm"] / "preprocessing" / "config.pbtxt")
    assert pre.parameters["tokenizer_dir"].string_value == str(llama_checkpoint)


def test_value_files_set_the_same_keys() -> None:
    assert static_values(TEMPLATE_DIR, "trtllm").keys() == static_values(TEMPLATE_DIR, "cpu").keys()


def test_render_fails_naming_missing_placeholder(tmp_path: Path, llama_checkpoint: Path) -> None:
    values = repository_values(TEMPLATE_DIR, "trtllm", engine_config_for(llama_checkpoint), tmp_path / "engine")
    del values["kv_cache_free_gpu_mem_fraction"]
    with pytest.raises(RenderError, match=r"unfilled placeholder \$\{kv_cache_free_gpu_mem_fraction\}"):
        render_repository(TEMPLATE_DIR, values, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- planned commands (--dry-run) -----------------------------------------------------------------------
def test_dry_run_llama(tmp_path: Path, llama_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "build"
    commands = dry_run(capsys, "--model", str(llama_checkpoint), "--output-dir", str(out))
    ckpt = str(out.resolve() / "trtllm_checkpoint")
    engine = str(out.resolve() / "engine")
    assert commands == [
        [
            sys.executable, f"{EXAMPLES}/models/core/llama/convert_checkpoint.py",
            "--model_dir", str(llama_checkpoint), "--output_dir", ckpt,
            "--dtype", "float16", "--tp_size", "1", "--pp_size", "1",
        ],
        [
            "trtllm-build", "--checkpoint_dir", ckpt, "--output_dir", engine,
            "--kv_cache_type", "paged", "--remove_input_padding", "enable", "--context_fmha", "enable",
            "--use_paged_context_fmha", "enable", "--gpt_attention_plugin", "float16", "--gemm_plugin", "float16",
            "--max_batch_size", "64", "--max_input_len", "1023", "--max_seq_len", "1024",
            "--max_num_tokens", "8192", "--max_beam_width", "1", "--workers", "1", "--gpus_per_node", "8",
        ],
    ]
    # A dry run builds nothing; it renders the repository the build would serve, and nothing else.
    assert sorted(p.name for p in out.iterdir()) == ["model_repository"]


def test_dry_run_renders_the_repository_it_would_serve(
    tmp_path: Path, llama_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "build"
    dry_run(capsys, "--model", str(llama_checkpoint), "--output-dir", str(out), "--max-seq-len", "512")
    engine = parse(out / "model_repository" / "tensorrt_llm" / "config.pbtxt")
    assert engine.backend == "tensorrtllm"
    parameters = {key: value.string_value for key, value in engine.parameters.items()}
    assert parameters["gpt_model_path"] == str((out / "engine").resolve())
    assert parameters["tokenizer_dir"] == str(llama_checkpoint.resolve())
    tokenizer_info = (out / "engine" / "xgrammar_tokenizer_info.json").resolve()
    assert parameters["xgrammar_tokenizer_info_path"] == str(tokenizer_info)
    assert parameters["guided_decoding_backend"] == "xgrammar"
    assert (parameters["max_seq_len"], parameters["max_top_logprobs"]) == ("512", "0")
    assert {p.parent.name for p in (out / "model_repository").glob("*/config.pbtxt")} == {
        "ensemble", "preprocessing", "postprocessing", "tensorrt_llm"}


def test_dry_run_never_overwrites_a_built_engine(
    tmp_path: Path, llama_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "build"
    (out / "engine").mkdir(parents=True)
    (out / "engine" / "engine_config.json").write_text("{}")
    (out / "model_repository").mkdir()
    args = ["--backend", "trtllm", "--dry-run", "--model", str(llama_checkpoint), "--output-dir", str(out)]
    assert build_main(args) == 2
    assert "already holds a built engine" in capsys.readouterr().err
    assert not any((out / "model_repository").iterdir())


def test_dry_run_qwen2_with_options(
    tmp_path: Path, qwen2_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "build"
    convert, build_cmd = dry_run(
        capsys, "--model", str(qwen2_checkpoint), "--output-dir", str(out), "--tp-size", "2",
        "--weight-only", "int4", "--max-batch-size", "16", "--max-seq-len", "512", "--max-input-len", "384",
        "--max-num-tokens", "2048", "--trtllm-examples-dir", "/opt/trtllm/examples",
    )
    assert convert[1] == "/opt/trtllm/examples/models/core/qwen/convert_checkpoint.py"
    assert convert[convert.index("--dtype") + 1] == "bfloat16"  # the checkpoint's dtype
    assert convert[convert.index("--tp_size") + 1] == "2"
    assert convert[-3:] == ["--use_weight_only", "--weight_only_precision", "int4"]
    flags = dict(zip(build_cmd[1::2], build_cmd[2::2]))
    assert flags["--gemm_plugin"] == flags["--gpt_attention_plugin"] == "bfloat16"
    assert (flags["--max_batch_size"], flags["--max_seq_len"], flags["--max_input_len"]) == ("16", "512", "384")
    assert (flags["--max_num_tokens"], flags["--workers"]) == ("2048", "2")
    assert flags["--checkpoint_dir"] == convert[convert.index("--output_dir") + 1]


def test_pipeline_parallel_plan_and_record(tmp_path: Path, llama_checkpoint: Path) -> None:
    """TP within a node x PP across nodes (overlays/multinode: 8 x 2): convert splits the checkpoint 16 ways,
    trtllm-build uses one worker per GPU of the building node, and the record says world size 16."""
    from build_engine.checkpoint import validate_checkpoint
    from build_engine.limits import EngineLimits

    checkpoint = validate_checkpoint(llama_checkpoint)
    limits = EngineLimits(max_batch_size=8, max_seq_len=1024, max_num_tokens=256)
    options = trtllm.TrtllmOptions(tp_size=8, pp_size=2)
    plan = trtllm.plan_build(checkpoint, limits, options, work_dir=tmp_path, engine_dir=tmp_path / "engine")
    convert, build_cmd = plan.commands
    assert convert[convert.index("--tp_size") + 1:convert.index("--tp_size") + 4] == ["8", "--pp_size", "2"]
    assert build_cmd[build_cmd.index("--workers") + 1] == "8"
    assert build_cmd[build_cmd.index("--gpus_per_node") + 1] == "8"  # the default; the overlay's GPUs per pod
    four = trtllm.plan_build(checkpoint, limits, trtllm.TrtllmOptions(tp_size=4, pp_size=2, gpus_per_node=4),
                             work_dir=tmp_path, engine_dir=tmp_path / "engine").commands[1]
    assert four[four.index("--gpus_per_node") + 1] == "4"
    record = trtllm.trtllm_engine_config(checkpoint, plan, limits, options, served_model_name="m", source={},
                                         version=VERSION, checkpoint_hash="0" * 64, xgrammar_tokenizer_info=None)
    assert (record["tp_size"], record["pp_size"], record["world_size"]) == (8, 2, 16)
    with pytest.raises(trtllm.BuildError, match="--pp-size must be at least 1"):
        trtllm.plan_build(checkpoint, limits, trtllm.TrtllmOptions(pp_size=0), work_dir=tmp_path,
                          engine_dir=tmp_path / "engine")


def test_dry_run_mistral_fp8_kv_cache(
    tmp_path: Path, llama_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mistral = patched_checkpoint(llama_checkpoint, tmp_path / "mistral", architectures=["MistralForCausalLM"])
    convert, _ = dry_run(capsys, "--model", str(mistral), "--output-dir", str(tmp_path / "b"),
                         "--kv-cache-dtype", "fp8", "--dtype", "bfloat16")
    assert convert[1].endswith("/models/core/llama/convert_checkpoint.py")
    assert convert[convert.index("--dtype") + 1] == "bfloat16"
    assert convert[-1] == "--fp8_kv_cache"


@pytest.mark.parametrize(
    ("architecture", "extra", "message"),
    [
        ("Gemma2ForCausalLM", (), "architecture Gemma2ForCausalLM is not supported by the TensorRT-LLM build"),
        ("Qwen2ForCausalLM", ("--kv-cache-dtype", "fp8"), "has no --fp8_kv_cache"),
        ("LlamaForCausalLM", ("--max-input-len", "1024"), "--max-input-len must be between 1 and"),
    ],
)
def test_dry_run_refusals(
    tmp_path: Path,
    llama_checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
    architecture: str,
    extra: tuple[str, ...],
    message: str,
) -> None:
    checkpoint = patched_checkpoint(llama_checkpoint, tmp_path / "ckpt", architectures=[architecture])
    args = ["--backend", "trtllm", "--dry-run", "--model", str(checkpoint), "--output-dir", str(tmp_path / "b")]
    assert build_main([*args, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_real_build_without_tensorrt_llm_fails_cleanly(
    tmp_path: Path, llama_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "build"
    assert build_main(["--backend", "trtllm", "--model", str(llama_checkpoint), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot build a TensorRT-LLM engine here")
    assert "--dry-run" in err
    assert not out.exists()


# --- a whole build with the TensorRT-LLM steps faked ----------------------------------------------------
@pytest.fixture()
def fake_toolchain(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Pretend TensorRT-LLM VERSION is installed; the commands are recorded and write a fake engine."""
    ran: list[list[str]] = []

    def run_build(plan: trtllm.TrtllmPlan) -> None:
        ran.extend(plan.commands)
        plan.engine_dir.mkdir(parents=True, exist_ok=True)
        (plan.engine_dir / "config.json").write_text(json.dumps({"version": VERSION}))
        (plan.engine_dir / "rank0.engine").write_bytes(b"engine")

    monkeypatch.setattr(trtllm, "check_toolchain", lambda plan: VERSION)
    monkeypatch.setattr(trtllm, "run_build", run_build)
    monkeypatch.setattr(trtllm, "installed_version", lambda: VERSION)
    return ran


def test_build_records_version_flags_and_hash(
    tmp_path: Path, llama_checkpoint: Path, fake_toolchain: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    request = BuildRequest(output_dir=tmp_path / "build", backend="trtllm", model=llama_checkpoint)
    result = build(request)
    config = json.loads((result.engine_dir / "engine_config.json").read_text())
    assert config["backend"] == "trtllm"
    assert config["tensorrt_llm_version"] == VERSION
    assert config["commands"] == fake_toolchain
    assert config["checkpoint_sha256"] == trtllm.checkpoint_sha256(llama_checkpoint)
    assert len(config["checkpoint_sha256"]) == 64
    assert (config["max_seq_len"], config["max_input_len"], config["world_size"]) == (1024, 1023, 1)
    engine = parse(result.repository_dir / "tensorrt_llm" / "config.pbtxt")
    assert engine.backend == "tensorrtllm"
    assert engine.parameters["gpt_model_path"].string_value == str(result.engine_dir)
    assert engine.parameters["max_seq_len"].string_value == "1024"
    tokenizer_info = Path(engine.parameters["xgrammar_tokenizer_info_path"].string_value)
    assert tokenizer_info == result.engine_dir / "xgrammar_tokenizer_info.json"
    assert json.loads(tokenizer_info.read_text())  # written after the build (which clears the engine folder)
    # The launcher's check accepts it; --if-missing reuses it only while the same version is installed.
    assert check_model_repository(result.repository_dir, installed_version=VERSION)["backend"] == "trtllm"
    explicit = BuildRequest(output_dir=tmp_path / "build", backend="trtllm", model=llama_checkpoint)
    assert existing_build(explicit) is not None
    monkeypatch.setattr(trtllm, "installed_version", lambda: "1.2.0")
    assert existing_build(explicit) is None


def test_checkpoint_hash_changes_with_content(tmp_path: Path, llama_checkpoint: Path) -> None:
    copy = Path(shutil.copytree(llama_checkpoint, tmp_path / "copy"))
    before = trtllm.checkpoint_sha256(copy)
    assert before == trtllm.checkpoint_sha256(llama_checkpoint)
    (copy / "generation_config.json").write_text("{}")
    assert trtllm.checkpoint_sha256(copy) != before


# --- serve-time version check ---------------------------------------------------------------------------
def write_engine(engine_dir: Path, version: str, written_by_trtllm_build: str | None = None) -> Path:
    engine_dir.mkdir(parents=True, exist_ok=True)
    (engine_dir / "engine_config.json").write_text(json.dumps({"backend": "trtllm", "tensorrt_llm_version": version}))
    if written_by_trtllm_build is not None:
        (engine_dir / "config.json").write_text(json.dumps({"version": written_by_trtllm_build}))
    return engine_dir


def test_version_check_refuses_mismatched_engine(tmp_path: Path) -> None:
    engine = write_engine(tmp_path / "engine", "1.0.0")
    with pytest.raises(EngineMismatchError, match=r"built with TensorRT-LLM 1\.0\.0 but TensorRT-LLM 1\.1\.0") as info:
        check_trtllm_engine(engine, installed_version="1.1.0")
    assert "rebuild the engine" in str(info.value)
    assert check_trtllm_engine(engine, installed_version="1.0.0")["tensorrt_llm_version"] == "1.0.0"


def test_version_check_reads_trtllm_build_record(tmp_path: Path) -> None:
    engine = write_engine(tmp_path / "engine", "1.1.0", written_by_trtllm_build="1.0.0")
    with pytest.raises(EngineMismatchError, match=r"config.json says .* 1\.0\.0"):
        check_trtllm_engine(engine, installed_version="1.1.0")


def test_version_check_without_tensorrt_llm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_check, "installed_trtllm_version", lambda: None)
    with pytest.raises(EngineMismatchError, match="TensorRT-LLM is not installed here"):
        check_trtllm_engine(write_engine(tmp_path / "engine", "1.1.0"))
    with pytest.raises(EngineMismatchError, match="no engine_config.json"):
        check_trtllm_engine(tmp_path / "missing")


def test_repository_check(repositories: dict[str, Path]) -> None:
    assert check_model_repository(repositories["cpu"], installed_version=VERSION) is None  # CPU engine: no-op
    engine_dir = repositories["trtllm"].parent / "engine"
    write_engine(engine_dir, "1.0.0")
    with pytest.raises(EngineMismatchError, match="built with TensorRT-LLM 1.0.0"):
        check_model_repository(repositories["trtllm"], installed_version=VERSION)
    assert issubclass(EngineMismatchError, engine_check.TritonStartError)  # launcher prints it as one line


# --- launch command -------------------------------------------------------------------------------------
def test_mpirun_argv_world_size_2() -> None:
    rank = [
        "--grpc-port=8001", "--http-port=8000", "--metrics-port=8002",
    ]
    assert tritonserver_argv(2, "/repo") == [
        "mpirun", "--allow-run-as-root",
        "-n", "1", "tritonserver", "--model-repository=/repo", *rank,
        "--disable-auto-complete-config", "--backend-config=python,shm-region-prefix-name=prefix0_",
        ":",
        "-n", "1", "tritonserver", "--model-repository=/repo", *rank,
        "--model-control-mode=explicit", "--load-model=tensorrt_llm",
        "--disable-auto-complete-config", "--backend-config=python,shm-region-prefix-name=prefix1_",
    ]


def test_single_gpu_runs_tritonserver_directly() -> None:
    argv = tritonserver_argv(1, "/repo", http_port=9100, grpc_port=9101, metrics_port=9102, address="127.0.0.1")
    assert argv[0] == "tritonserver"
    assert "mpirun" not in argv and ":" not in argv
    assert "--grpc-address=127.0.0.1" in argv and "--grpc-port=9101" in argv
    assert "--model-control-mode=explicit" not in argv
    with pytest.raises(ValueError):
        tritonserver_argv(0, "/repo")


def test_mpi_entry_point(
    tmp_path: Path, llama_checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    repository = render("trtllm", llama_checkpoint, tmp_path / "repo", tmp_path / "engine")
    write_engine(tmp_path / "engine", "1.0.0")
    monkeypatch.setattr(engine_check, "installed_trtllm_version", lambda: "1.1.0")
    assert mpi_main(["--model-repository", str(repository), "--print"]) == 1
    assert "built with TensorRT-LLM 1.0.0" in capsys.readouterr().err
    config = json.loads((tmp_path / "engine" / "engine_config.json").read_text())
    (tmp_path / "engine" / "engine_config.json").write_text(json.dumps({**config, "tensorrt_llm_version": "1.1.0",
                                                                       "world_size": 2}))
    assert mpi_main(["--model-repository", str(repository), "--print"]) == 0
    printed = shlex.split(capsys.readouterr().out)
    assert printed[:2] == ["mpirun", "--allow-run-as-root"] and printed.count("tritonserver") == 2


# --- docker ---------------------------------------------------------------------------------------------
def test_image_pin_is_stated_once() -> None:
    pin = "nvcr.io/nvidia/tritonserver:"
    files = [*sorted((REPO_ROOT / "docker").iterdir()), REPO_ROOT / "Makefile"]
    holders = [path.name for path in files if path.is_file() and pin in path.read_text()]
    assert holders == ["Dockerfile.trtllm"]


def test_a_tokenizer_guided_decoding_cannot_use_leaves_the_path_empty(
    tmp_path: Path, llama_checkpoint: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from build_engine import pipeline
    from build_engine.xgrammar_info import XgrammarInfoError

    def refuse(checkpoint_dir: Path) -> dict[str, Any]:
        raise XgrammarInfoError("the tokenizer has no eos token")

    monkeypatch.setattr(pipeline, "tokenizer_info", refuse)
    out = tmp_path / "build"
    args = ["--backend", "trtllm", "--dry-run", "--model", str(llama_checkpoint), "--output-dir", str(out)]
    assert build_main(args) == 0
    assert "guided decoding will not be available" in capsys.readouterr().err
    engine = parse(out / "model_repository" / "tensorrt_llm" / "config.pbtxt")
    assert engine.parameters["xgrammar_tokenizer_info_path"].string_value == ""


def test_max_lora_rank_builds_the_lora_plugin_and_sizes_the_lora_cache(tmp_path: Path, llama_checkpoint: Path) -> None:
    """`make engine BACKEND=trtllm MAX_LORA_RANK=16`: trtllm-build with the LoRA plugin, the rank and the target
    modules; the rendered config's lora_cache_max_adapter_size is that rank. Without it: no LoRA flags."""
    from build_engine.checkpoint import validate_checkpoint
    from build_engine.limits import EngineLimits
    from build_engine.values import engine_values

    checkpoint = validate_checkpoint(llama_checkpoint)
    limits = EngineLimits(max_batch_size=8, max_seq_len=1024, max_num_tokens=256)
    options = trtllm.TrtllmOptions(max_lora_rank=16, lora_target_modules=("attn_q", "attn_v"))
    plan = trtllm.plan_build(checkpoint, limits, options, work_dir=tmp_path, engine_dir=tmp_path / "engine")
    build_cmd = plan.commands[1]
    assert build_cmd[build_cmd.index("--lora_plugin"):] == ["--lora_plugin", plan.dtype, "--max_lora_rank", "16",
                                                             "--lora_target_modules", "attn_q", "attn_v"]
    record = trtllm.trtllm_engine_config(checkpoint, plan, limits, options, served_model_name="m", source={},
                                         version=VERSION, checkpoint_hash="0" * 64, xgrammar_tokenizer_info=None)
    assert engine_values(record, tmp_path / "engine")["lora_cache_max_adapter_size"] == "16"
    plain = trtllm.plan_build(checkpoint, limits, trtllm.TrtllmOptions(), work_dir=tmp_path, engine_dir=tmp_path / "e")
    assert "--lora_plugin" not in plain.commands[1]
    with pytest.raises(trtllm.BuildError, match="--lora-target-modules"):
        trtllm.plan_build(checkpoint, limits, trtllm.TrtllmOptions(max_lora_rank=8, lora_target_modules=("q_proj",)),
                          work_dir=tmp_path, engine_dir=tmp_path / "e")

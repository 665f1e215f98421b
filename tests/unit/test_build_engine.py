"""build_engine: demo checkpoint, checkpoint validation, strict rendering and the CLI."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from build_engine.__main__ import main
from build_engine.checkpoint import CheckpointError, validate_checkpoint
from build_engine.demo_checkpoint import STAMP_FILE, ensure_demo_checkpoint
from build_engine.errors import BuildError
from build_engine.limits import resolve_limits
from build_engine.pipeline import TEMPLATE_DIR, BuildRequest, build, existing_build
from build_engine.render import RenderError, render_repository, template_placeholders

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny")


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> BuildRequest:
    """A full build in its own folder; the module's demo checkpoint is copied in, so not regenerated."""
    output_dir = tmp_path_factory.mktemp("build")
    shutil.copytree(tiny_checkpoint, output_dir / "checkpoints" / "demo-tiny")
    request = BuildRequest(output_dir=output_dir, preset="tiny")
    build(request)
    return request


def all_placeholders() -> set[str]:
    return set().union(*template_placeholders(TEMPLATE_DIR).values())


def full_values() -> dict[str, str]:
    return {name: "1" for name in all_placeholders()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- rendering -----------------------------------------------------------------------------------------


def test_render_fails_naming_missing_placeholder(tmp_path: Path) -> None:
    values = full_values()
    del values["engine_dir"]
    with pytest.raises(RenderError, match=r"\$\{engine_dir\} in .*tensorrt_llm/config.pbtxt"):
        render_repository(TEMPLATE_DIR, values, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_render_fails_on_unused_key(tmp_path: Path) -> None:
    values = {**full_values(), "engine_dri": "x"}
    with pytest.raises(RenderError, match="'engine_dri' is used by no template"):
        render_repository(TEMPLATE_DIR, values, tmp_path / "out")


def test_render_refuses_template_dir(tmp_path: Path) -> None:
    for out_dir in (TEMPLATE_DIR, TEMPLATE_DIR / "rendered", TEMPLATE_DIR.parent):
        with pytest.raises(RenderError, match="overlaps the template directory"):
            render_repository(TEMPLATE_DIR, full_values(), out_dir)
    assert (TEMPLATE_DIR / "tensorrt_llm" / "config.pbtxt").is_file()


def test_render_rejects_values_that_break_pbtxt(tmp_path: Path) -> None:
    values = {**full_values(), "served_model_name": 'bad"name'}
    with pytest.raises(RenderError, match="served_model_name"):
        render_repository(TEMPLATE_DIR, values, tmp_path / "out")


def test_cpu_values_cover_every_placeholder(tiny_build: BuildRequest) -> None:
    rendered = "".join(p.read_text() for p in tiny_build.repository_dir.glob("*/config.pbtxt"))
    assert "${" not in rendered
    assert not (tiny_build.repository_dir / "values").exists()


def test_rendered_configs_parse_as_triton_model_configs(tiny_build: BuildRequest) -> None:
    configs = sorted(tiny_build.repository_dir.glob("*/config.pbtxt"))
    assert {p.parent.name for p in configs} == {"ensemble", "preprocessing", "postprocessing", "tensorrt_llm"}
    for path in configs:
        config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        assert config.name == path.parent.name
        assert config.max_batch_size == 16
    assert (tiny_build.repository_dir / "ensemble" / "1").is_dir()  # empty version dir kept
    assert not list(tiny_build.repository_dir.rglob("__pycache__"))


def test_engine_config_records_build(tiny_build: BuildRequest, tiny_checkpoint: Path) -> None:
    config = json.loads((tiny_build.engine_dir / "engine_config.json").read_text())
    assert config["backend"] == "cpu"
    assert config["served_model_name"] == "demo-tiny"
    assert config["architecture"] == "LlamaForCausalLM"
    assert config["source"] == {"preset": "tiny"}
    assert (config["max_batch_size"], config["max_seq_len"], config["max_num_tokens"]) == (16, 1024, 512)
    assert Path(config["checkpoint_dir"]).is_absolute()
    engine_text = (tiny_build.repository_dir / "tensorrt_llm" / "config.pbtxt").read_text()
    engine = text_format.Parse(engine_text, model_config_pb2.ModelConfig())
    assert engine.backend == "python"
    assert engine.parameters["gpt_model_path"].string_value == str(tiny_build.engine_dir.resolve())
    assert engine.parameters["served_model_name"].string_value == "demo-tiny"


# --- demo checkpoint ------------------------------------------------------------------------------------


def test_demo_checkpoint_is_deterministic(tmp_path: Path, tiny_checkpoint: Path) -> None:
    again = ensure_demo_checkpoint(tmp_path, "tiny")
    for name in ("model.safetensors", "tokenizer.json"):
        assert sha256(again / name) == sha256(tiny_checkpoint / name)


def test_demo_checkpoint_is_not_regenerated(tiny_checkpoint: Path) -> None:
    before = (tiny_checkpoint / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_checkpoint(tiny_checkpoint.parents[1], "tiny") == tiny_checkpoint
    assert (tiny_checkpoint / "model.safetensors").stat().st_mtime_ns == before
    assert json.loads((tiny_checkpoint / STAMP_FILE).read_text())["preset"] == "tiny"


def test_tokenizer_round_trips_unicode(tiny_checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    text = "Hello 世界 😀 ok"
    ids = tokenizer.encode(text)
    assert tokenizer.bos_token_id not in ids  # bos is not added automatically
    assert tokenizer.decode(ids) == text


def test_every_single_token_decodes(tiny_checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert len(tokenizer) == 4096
    for token_id in range(len(tokenizer)):
        assert isinstance(tokenizer.decode([token_id], skip_special_tokens=True), str)


def test_chat_template_renders(tiny_checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"


def test_model_config_uses_tokenizer_special_ids(tiny_checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert config["tie_word_embeddings"] is False
    assert (tiny_checkpoint / "generation_config.json").is_file()


# --- checkpoint validation ------------------------------------------------------------------------------


def copy_checkpoint(source: Path, target: Path, skip: tuple[str, ...] = ()) -> Path:
    target.mkdir()
    for path in source.iterdir():
        if path.name not in skip:
            shutil.copy(path, target / path.name)
    return target


def test_validation_accepts_demo(tiny_checkpoint: Path) -> None:
    info = validate_checkpoint(tiny_checkpoint)
    assert (info.architecture, info.max_position_embeddings) == ("LlamaForCausalLM", 1024)


def test_validation_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        validate_checkpoint(tmp_path / "nope")


def test_validation_no_config(tmp_path: Path, tiny_checkpoint: Path) -> None:
    directory = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt", skip=("config.json",))
    with pytest.raises(CheckpointError, match="has no config.json"):
        validate_checkpoint(directory)


def test_validation_not_causal_lm(tmp_path: Path, tiny_checkpoint: Path) -> None:
    directory = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not describe a causal language model"):
        validate_checkpoint(directory)


def test_validation_no_weights(tmp_path: Path, tiny_checkpoint: Path) -> None:
    directory = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt", skip=("model.safetensors",))
    with pytest.raises(CheckpointError, match="no model weights"):
        validate_checkpoint(directory)


def test_validation_no_tokenizer(tmp_path: Path, tiny_checkpoint: Path) -> None:
    keep = ("config.json", "model.safetensors", "generation_config.json")
    skip = tuple(p.name for p in tiny_checkpoint.iterdir() if p.name not in keep)
    directory = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt", skip=skip)
    with pytest.raises(CheckpointError, match="no tokenizer could be loaded"):
        validate_checkpoint(directory)


# --- limits and CLI -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_seq_len": 4096}, "exceeds the model's context length"),
        ({"max_num_tokens": 0}, "--max-num-tokens must be at least 1"),
        ({"max_batch_size": 0}, "--max-batch-size must be at least 1"),
        ({"max_batch_size": 64, "max_num_tokens": 32}, "below --max-batch-size"),
    ],
)
def test_limits_rejected(overrides: dict[str, int], message: str) -> None:
    settings = {"max_batch_size": None, "max_seq_len": None, "max_num_tokens": None, **overrides}
    with pytest.raises(BuildError, match=message):
        resolve_limits(max_position_embeddings=1024, preset="tiny", **settings)


def test_cli_trtllm_needs_tensorrt_llm(tmp_path: Path) -> None:
    """Without TensorRT-LLM (CI, any CPU machine) a real trtllm build stops before writing anything."""
    result = subprocess.run(
        [sys.executable, "-m", "build_engine", "--backend", "trtllm", "--output-dir", str(tmp_path / "out"),
         "--model", str(tmp_path / "missing")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: checkpoint directory")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_cli_bad_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: checkpoint directory")


def test_cli_if_missing(tiny_build: BuildRequest, capsys: pytest.CaptureFixture[str]) -> None:
    output = str(tiny_build.output_dir)
    assert main(["--output-dir", output, "--if-missing"]) == 0
    assert "engine already built at" in capsys.readouterr().out
    assert main(["--output-dir", output, "--preset", "tiny", "--if-missing"]) == 0
    assert existing_build(BuildRequest(output_dir=tiny_build.output_dir, preset="small")) is None


def test_if_missing_rebuilds_a_cpu_repository_whose_model_code_is_stale(tiny_build: BuildRequest) -> None:
    """After an upgrade, a repository rendered by the old checkout carries the old model.py, which may not
    match the engine package it would run with: --if-missing must not serve it as is."""
    assert existing_build(tiny_build) is not None
    copied = tiny_build.repository_dir / "tensorrt_llm" / "1" / "model.py"
    original = copied.read_text()
    copied.write_text(original + "\n# rendered by an older checkout\n")
    try:
        assert existing_build(tiny_build) is None
    finally:
        copied.write_text(original)
    assert existing_build(tiny_build) is not None


def test_weights_int8_are_quantized_at_build_time_into_the_engine_directory(
        tiny_checkpoint: Path, tmp_path: Path) -> None:
    """`--weights int8`, a plain build and a named version: the int8 file beside the engine config, which
    records the format; `--if-missing` does not take a float32 build for an int8 one."""
    from cpu_engine.config import INT8_WEIGHTS_FILE, EngineConfig

    out = tmp_path / "build"
    assert main(["--model", str(tiny_checkpoint), "--output-dir", str(out), "--max-seq-len", "64"]) == 0
    int8_request = BuildRequest(output_dir=out, model=tiny_checkpoint, weights="int8")
    assert existing_build(int8_request) is None  # the float32 engine there is not the int8 one asked for
    assert main(["--model", str(tiny_checkpoint), "--output-dir", str(out), "--max-seq-len", "64",
                 "--weights", "int8"]) == 0
    assert existing_build(int8_request) is not None
    config = EngineConfig.from_engine_dir(out / "engine")
    assert json.loads((out / "engine" / "engine_config.json").read_text())["weights"] == "int8"
    assert config.weights == "int8" and (out / "engine" / INT8_WEIGHTS_FILE).is_file()

    assert main(["--model", str(tiny_checkpoint), "--output-dir", str(out), "--max-seq-len", "64",
                 "--weights", "int8", "--name", "quantized"]) == 0
    engine_dir = out / "models" / "quantized" / "1" / "engine"
    record = json.loads((engine_dir / "engine_config.json").read_text())
    assert record["weights"] == "int8" and record["build_flags"]["weights"] == "int8"
    assert (engine_dir / INT8_WEIGHTS_FILE).is_file()

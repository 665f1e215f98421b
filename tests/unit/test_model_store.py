"""Named models: numbered versions built by ``python -m build_engine --name`` and the store that holds them."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from build_engine import model_store, trtllm
from build_engine.__main__ import main
from build_engine.demo_checkpoint import ensure_demo_checkpoint
from build_engine.errors import BuildError
from build_engine.model_store import ManagedModel, ModelStoreError, check_name, managed_models
from build_engine.pipeline import BuildRequest, build_version

NAME = "assistant"
TINY = ["--preset", "tiny", "--max-seq-len", "256", "--max-batch-size", "4"]


def named_build(out: Path, *extra: str, name: str = NAME) -> int:
    return main([*TINY, "--name", name, "--output-dir", str(out), *extra])


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny")


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> dict[str, object]:
    """OUT with versions 1 and 2 of NAME built through the CLI, and what stood after the first build."""
    out = tmp_path_factory.mktemp("named")
    shutil.copytree(tiny_checkpoint, out / "checkpoints" / "demo-tiny")  # not regenerated
    assert named_build(out) == 0
    model = ManagedModel(out.resolve() / "models" / NAME)
    after_first = {"config": model.config_path.read_bytes(), "state": model.state(),
                   "link": model.live_link_target()}
    assert named_build(out) == 0
    return {"out": out, "model": model, "after_first": after_first}


# ----- the builds ----------------------------------------------------------------------------------------
def test_first_build_creates_a_live_version_1(two_versions: dict[str, object]) -> None:
    out, model = two_versions["out"], two_versions["model"]
    assert isinstance(model, ManagedModel) and isinstance(out, Path)
    version_dir = model.version_dir(1)
    assert (version_dir / "model.py").is_file()
    record = model.record(1)
    assert (record["name"], record["model_version"], record["served_model_name"]) == (NAME, 1, NAME)
    assert re.fullmatch(r"[0-9a-f]{64}", record["checkpoint_sha256"])
    assert record["checkpoint_sha256"] == trtllm.checkpoint_sha256(model.checkpoint_dir(1))  # a full copy
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", record["built_at"])
    assert record["build_flags"] == {"max_batch_size": 4, "max_seq_len": 256, "tp_size": 1, "pp_size": 1}
    assert record["source"] == {"preset": "tiny"}
    assert record["checkpoint_dir"] == str(model.checkpoint_dir(1))
    assert Path(record["checkpoint_dir"]).is_absolute()
    for name in ("model.safetensors", "tokenizer.json"):
        assert (model.checkpoint_dir(1) / name).is_file()

    after_first = two_versions["after_first"]
    assert isinstance(after_first, dict)
    assert after_first["state"] == {"live": 1, "previous": None}
    assert after_first["link"] == 1
    config = parse(after_first["config"].decode())
    assert config.name == NAME
    assert config.parameters["gpt_model_path"].string_value == str(model.directory / "live" / "engine")
    assert config.parameters["tokenizer_dir"].string_value == str(model.directory / "live" / "checkpoint")
    assert config.parameters["served_model_name"].string_value == NAME
    assert list(config.version_policy.specific.versions) == [1]
    assert [m.name for m in managed_models(out / "models")] == [NAME]
    # Engine model only: the frontend tokenizes.
    assert sorted(p.name for p in (out / "models").iterdir()) == [NAME]


def test_second_build_is_on_disk_but_not_live(two_versions: dict[str, object]) -> None:
    model, after_first = two_versions["model"], two_versions["after_first"]
    assert isinstance(model, ManagedModel) and isinstance(after_first, dict)
    assert model.versions() == [1, 2]
    assert model.record(2)["model_version"] == 2
    assert model.record(2)["checkpoint_dir"] == str(model.checkpoint_dir(2))
    assert model.config_path.read_bytes() == after_first["config"]  # byte for byte: policy still [1]
    assert model.loaded_versions() == [1]
    assert model.live_link_target() == 1
    assert model.state() == {"live": 1, "previous": None}


def test_a_build_with_other_limits_is_refused(
    two_versions: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    out, model = two_versions["out"], two_versions["model"]
    assert isinstance(model, ManagedModel) and isinstance(out, Path)
    before = model.config_path.read_bytes()
    capsys.readouterr()
    assert main(["--preset", "tiny", "--max-seq-len", "512", "--max-batch-size", "4", "--name", NAME,
                 "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert '-  value: { string_value: "256" }' in err and '+  value: { string_value: "512" }' in err
    assert "share Triton's config" in err and "--name" in err
    assert model.versions() == [1, 2]
    assert sorted(p.name for p in model.directory.iterdir()) == [".lock", "1", "2", "config.pbtxt", "live",
                                                                 "rollout.json"]  # .lock: the model's lock
    assert model.config_path.read_bytes() == before


def test_if_missing_finds_a_version_from_the_same_source(
    two_versions: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    out, model = two_versions["out"], two_versions["model"]
    assert isinstance(model, ManagedModel) and isinstance(out, Path)
    capsys.readouterr()
    assert named_build(out, "--if-missing") == 0
    assert "version 2" in capsys.readouterr().out
    assert model.versions() == [1, 2]


def test_failed_build_leaves_no_version(
    two_versions: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, model = two_versions["out"], two_versions["model"]
    assert isinstance(model, ManagedModel) and isinstance(out, Path)
    from build_engine import pipeline

    def fail(*args: object, **kwargs: object) -> None:
        raise BuildError("disk full")

    monkeypatch.setattr(pipeline, "write_engine_config", fail)
    (model.directory / ".staging-3").mkdir()  # a leftover of an interrupted build
    with pytest.raises(BuildError, match="disk full"):
        build_version(BuildRequest(output_dir=out, preset="tiny", max_seq_len=256, max_batch_size=4), NAME)
    assert not (model.directory / "3").exists() and not (model.directory / ".staging-3").exists()
    assert model.versions() == [1, 2]


def test_prune_after_a_build_keeps_live_and_newest(tmp_path: Path, tiny_checkpoint: Path) -> None:
    shutil.copytree(tiny_checkpoint, tmp_path / "checkpoints" / "demo-tiny")
    request = BuildRequest(output_dir=tmp_path, preset="tiny", max_seq_len=256, max_batch_size=4)
    assert [build_version(request, NAME).version for _ in range(2)] == [1, 2]
    result = build_version(request, NAME, keep_versions=2)
    assert (result.version, result.live_version, result.pruned) == (3, 1, [2])
    model = ManagedModel(tmp_path.resolve() / "models" / NAME)
    assert model.versions() == [1, 3]
    # A version number is never reused, even for a pruned version.
    model.commit(live=3, previous=1)
    result = build_version(request, NAME, keep_versions=1)
    assert (result.version, result.pruned) == (4, [])  # live 3 and previous 1 protected; 4 is the new one
    assert model.versions() == [1, 3, 4]


def test_named_trtllm_build(
    tmp_path: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The TensorRT-LLM steps faked: the engine lands in the version, the weights stay out of its checkpoint,
    and the paths recorded and rendered name the final directory and the live link."""
    ran: list[trtllm.TrtllmPlan] = []

    def run_build(plan: trtllm.TrtllmPlan) -> None:
        ran.append(plan)
        if plan.engine_dir.exists():
            shutil.rmtree(plan.engine_dir)
        plan.engine_dir.mkdir(parents=True)
        (plan.engine_dir / "config.json").write_text(json.dumps({"version": "1.1.0"}))
        (plan.engine_dir / "rank0.engine").write_bytes(b"engine")

    monkeypatch.setattr(trtllm, "check_toolchain", lambda plan: "1.1.0")
    monkeypatch.setattr(trtllm, "run_build", run_build)
    args = ["--backend", "trtllm", "--model", str(tiny_checkpoint), "--max-seq-len", "256", "--name", "gpu",
            "--output-dir", str(tmp_path)]
    assert main(args) == 0
    model = ManagedModel(tmp_path.resolve() / "models" / "gpu")
    assert [p.engine_dir for p in ran] == [model.directory / ".staging-1" / "engine"]
    assert ran[0].commands[0][ran[0].commands[0].index("--model_dir") + 1] == str(tiny_checkpoint)
    assert sorted(p.name for p in model.version_dir(1).iterdir()) == ["checkpoint", "engine"]
    assert (model.engine_dir(1) / "rank0.engine").is_file()
    assert not list(model.checkpoint_dir(1).glob("*.safetensors"))
    assert (model.checkpoint_dir(1) / "tokenizer.json").is_file()
    record = model.record(1)
    assert record["xgrammar_tokenizer_info"] == str(model.engine_dir(1) / "xgrammar_tokenizer_info.json")
    assert (model.engine_dir(1) / "xgrammar_tokenizer_info.json").is_file()
    assert record["checkpoint_dir"] == str(model.checkpoint_dir(1))
    # Of the checkpoint the engine was built from, weights included: the version's copy has none.
    assert record["checkpoint_sha256"] == trtllm.checkpoint_sha256(tiny_checkpoint)
    config = parse(model.config_path.read_text())
    assert (config.name, config.backend) == ("gpu", "tensorrtllm")
    live_engine = model.directory / "live" / "engine"
    assert config.parameters["gpt_model_path"].string_value == str(live_engine)
    assert config.parameters["xgrammar_tokenizer_info_path"].string_value == str(
        live_engine / "xgrammar_tokenizer_info.json")
    assert list(config.version_policy.specific.versions) == [1]
    assert model.state() == {"live": 1, "previous": None}


# ----- the CLI --------------------------------------------------------------------------------------------
def test_dry_run_with_name_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", "trtllm", "--dry-run", "--name", NAME, "--output-dir", str(tmp_path)]) == 2
    assert "--dry-run" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("bad", ["live", "", "a/b", "../x"])
def test_cli_refuses_bad_names(tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--name", bad, "--output-dir", str(tmp_path)]) == 2
    assert "model name" in capsys.readouterr().err


def test_cli_refuses_keep_versions_below_1(tmp_path: Path) -> None:
    assert main(["--name", NAME, "--keep-versions", "0", "--output-dir", str(tmp_path)]) == 2


# ----- the store ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["live", "", "a/b", "../x", ".hidden", "x" * 65])
def test_check_name_refuses(bad: str) -> None:
    with pytest.raises(ModelStoreError):
        check_name(bad)


@pytest.mark.parametrize("good", ["assistant", "llama-3.1_8b", "A", "x" * 64])
def test_check_name_accepts(good: str) -> None:
    assert check_name(good) == good


def fake_model(root: Path, versions: list[int], live: int, previous: int | None) -> ManagedModel:
    """A model directory with empty engine records: enough for everything but serving."""
    model = ManagedModel(root / NAME)
    for version in versions:
        model.engine_dir(version).mkdir(parents=True)
        (model.engine_dir(version) / model_store.ENGINE_RECORD).write_text(json.dumps({"model_version": version}))
    model.config_path.write_text(f'name: "{NAME}"\nbackend: "python"\n{model_store.version_policy_line([live])}\n')
    model.point_live_link(live)
    model.commit(live=live, previous=previous)
    return model


def test_prune_never_removes_live_previous_or_newest(tmp_path: Path) -> None:
    model = fake_model(tmp_path, [1, 2, 3, 4, 5], live=2, previous=1)
    assert model.prune(1) == [3, 4]
    assert model.versions() == [1, 2, 5]
    model = fake_model(tmp_path / "b", [1, 2, 3, 4, 5], live=4, previous=2)
    assert model.prune(3) == [1, 3]
    assert model.versions() == [2, 4, 5]
    assert model.prune(3) == []


def test_versions_ignores_incomplete_directories(tmp_path: Path) -> None:
    model = fake_model(tmp_path, [1, 2], live=1, previous=None)
    (model.directory / "3" / "engine").mkdir(parents=True)  # no record: an interrupted build
    (model.directory / ".staging-4").mkdir()
    assert model.versions() == [1, 2]


def test_set_loaded_and_loaded_versions(tmp_path: Path) -> None:
    model = fake_model(tmp_path, [1, 2], live=1, previous=None)
    assert model.loaded_versions() == [1]
    model.set_loaded([2, 1])
    assert model.loaded_versions() == [1, 2]
    assert "versions: [ 1, 2 ]" in model.config_path.read_text()
    assert model_store.without_policy(model.config_path.read_text()).count("version_policy") == 0
    model.set_loaded([2])
    assert model.loaded_versions() == [2]
    assert model.config_path.read_text().startswith(f'name: "{NAME}"\n')


def test_point_live_link_replaces_the_link(tmp_path: Path) -> None:
    model = fake_model(tmp_path, [1, 2], live=1, previous=None)
    model.point_live_link(2)
    assert os.readlink(model.live_link) == "2"
    assert model.live_link_target() == 2
    assert (model.live_link / "engine" / model_store.ENGINE_RECORD).is_file()
    model.point_live_link(1)
    assert model.live_link_target() == 1
    assert not (model.directory / ".live.tmp").exists()


def test_commit_and_state(tmp_path: Path) -> None:
    model = fake_model(tmp_path, [1, 2], live=1, previous=None)
    model.commit(live=2, previous=1)
    assert model.state() == {"live": 2, "previous": 1}
    assert (model.live_version, model.previous_version) == (2, 1)


def test_settle_repairs_an_interrupted_rollout(tmp_path: Path) -> None:
    model = fake_model(tmp_path, [1, 2], live=1, previous=None)
    assert model.settle() is None
    model.set_loaded([1, 2])
    model.point_live_link(2)
    repaired = model.settle()
    assert repaired is not None and "[1, 2] -> [1]" in repaired and "live -> 1" in repaired
    assert model.loaded_versions() == [1]
    assert model.live_link_target() == 1
    assert model.settle() is None


def test_managed_models_and_find_model(tmp_path: Path) -> None:
    fake_model(tmp_path, [1], live=1, previous=None)
    (tmp_path / "unmanaged").mkdir()  # a model directory without rollout.json
    assert [m.name for m in managed_models(tmp_path)] == [NAME]
    assert managed_models(tmp_path / "missing") == []
    assert model_store.find_model(tmp_path, NAME).name == NAME
    with pytest.raises(ModelStoreError, match="models there: assistant"):
        model_store.find_model(tmp_path, "other")


# ----- the model's lock: builds (prune) and rollouts in different processes ----------------------------
def test_prune_spares_what_a_rollout_in_progress_names(tmp_path: Path) -> None:
    # A rollout from 5 to 2 (neither the previous version nor the newest) has put 2 in the policy and the link.
    model = fake_model(tmp_path, [1, 2, 3, 4, 5], live=5, previous=4)
    model.set_loaded([5, 2])
    model.point_live_link(2)
    assert model.prune(1) == [1, 3]
    assert model.versions() == [2, 4, 5]
    assert not [p.name for p in model.directory.iterdir() if p.name.startswith(".pruned-")]
    # The link alone (an interrupted rollout that settle() has not repaired yet) protects its version too.
    model = fake_model(tmp_path / "b", [1, 2, 3, 4], live=4, previous=None)
    model.point_live_link(2)
    assert model.prune(1) == [1, 3]


def test_prune_in_another_process_waits_for_the_lock_then_spares_the_version_being_loaded(tmp_path: Path) -> None:
    model = fake_model(tmp_path, [1, 2, 3, 4, 5], live=5, previous=4)
    code = ("import sys; from pathlib import Path; from build_engine.model_store import ManagedModel; "
            "print(ManagedModel(Path(sys.argv[1])).prune(1))")
    repo = Path(__file__).resolve().parents[2]
    with model.locked():  # as frontend/models/rollout.py does before it loads version 2
        build = subprocess.Popen([sys.executable, "-c", code, str(model.directory)], cwd=repo,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.0)  # the child has started and reached the lock (it imports the standard library only)
            assert build.poll() is None, build.communicate()
            assert model.versions() == [1, 2, 3, 4, 5]
            model.set_loaded([5, 2])
            model.point_live_link(2)
        except BaseException:
            build.kill()
            raise
    out, err = build.communicate(timeout=60)
    assert build.returncode == 0, err
    assert out.strip() == "[1, 3]"
    assert model.versions() == [2, 4, 5]


def test_the_lock_is_exclusive_across_open_files(tmp_path: Path) -> None:
    model = fake_model(tmp_path, [1], live=1, previous=None)
    with model.locked():
        fd = os.open(model.directory / model_store.LOCK_FILE, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    with model.locked():  # released on exit: takes it again at once
        pass

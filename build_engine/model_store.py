"""Named models on disk: one Triton model per served model, one numbered version directory per build.

    <repository>/<name>/config.pbtxt     Triton's config, shared by every version of the model; its
                                         version_policy lists the versions Triton keeps loaded
    <repository>/<name>/<N>/             version N: model.py (CPU engine), engine/ (engine_config.json: the
                                         engine record), checkpoint/ (its own copy of tokenizer, template
                                         and, for the CPU engine, weights)
    <repository>/<name>/live             link to the version directory Triton loads next (see below)
    <repository>/<name>/rollout.json     {"live": N, "previous": M}: what serves, and what rollback restores
    <repository>/<name>/.lock            the model's lock (flock): the build's placing and pruning of versions
                                         and the rollout's edits of policy, link and state hold it

Why it is shaped like this (measured against tritonserver 2.51 in explicit model-control mode):
- Triton keeps one config per model for all its versions, and a `load` of a model whose config changed
  only in its version_policy initialises the versions added and unloads the versions dropped, leaving the
  others serving untouched. So the version_policy on disk is what is loaded, and a rollout is two edits of
  it ([old] -> [old, new] -> [new]), each followed by a `load`. A load that fails leaves the versions that
  were serving as they were.
- Because the config is shared, nothing in it may differ between versions: the build refuses a version
  whose rendered config would (another --max-seq-len, say), and the paths in it go through the `live`
  link, which the rollout points at the version it is about to load. The TensorRT-LLM C++ backend reads
  `gpt_model_path` and nothing version-specific, so the link is how it finds version N's engine; the CPU
  engine model knows its version and reads `<N>/engine` directly.
- Every version holds its own checkpoint copy: a rollback must load the weights that served before, even
  if the checkpoint folder it was built from has been overwritten since.
- The build (`make engine NAME=...`) and the frontend's rollout are different processes that edit one
  directory: each edit takes the model's lock (`locked()`, an flock on `.lock`), and pruning never deletes a
  version that the version_policy, the `live` link or rollout.json names. A rollout names the version it is
  about to load in the policy under the lock, before loading it, so a build's prune cannot take it away.

Standard library only: the frontend, the launcher and the build all read it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.pbtxt"
STATE_FILE = "rollout.json"
LIVE_LINK = "live"
LOCK_FILE = ".lock"
ENGINE_DIR = "engine"
CHECKPOINT_DIR = "checkpoint"
ENGINE_RECORD = "engine_config.json"
DEFAULT_KEEP_VERSIONS = 3
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_POLICY_LINE = re.compile(r"^version_policy:.*$", re.MULTILINE)


class ModelStoreError(RuntimeError):
    """The store is not what it should be, or an operation on it cannot be done; the message says why."""


def check_name(name: str) -> str:
    """Model names become Triton model names, directory names and URL path segments."""
    if not NAME_PATTERN.fullmatch(name) or name == LIVE_LINK:
        raise ModelStoreError(f"model name {name!r}: use letters, digits, '.', '_' or '-' (at most 64, not "
                              f"starting with a symbol)")
    return name


def version_policy_line(versions: list[int]) -> str:
    return f"version_policy: {{ specific: {{ versions: [ {', '.join(str(v) for v in sorted(versions))} ] }} }}"


def without_policy(config_text: str) -> str:
    """A config's text with its version_policy removed: what every version of a model must agree on."""
    return _POLICY_LINE.sub("", config_text).rstrip() + "\n"


def write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text)
    os.replace(staging, path)


@dataclass(frozen=True)
class ManagedModel:
    """One named model's directory (a Triton model directory with the layout above)."""

    directory: Path

    @property
    def name(self) -> str:
        return self.directory.name

    @property
    def config_path(self) -> Path:
        return self.directory / CONFIG_FILE

    def version_dir(self, version: int) -> Path:
        return self.directory / str(version)

    def engine_dir(self, version: int) -> Path:
        return self.version_dir(version) / ENGINE_DIR

    def checkpoint_dir(self, version: int) -> Path:
        return self.version_dir(version) / CHECKPOINT_DIR

    @property
    def live_link(self) -> Path:
        return self.directory / LIVE_LINK

    # ----- what is on disk ---------------------------------------------------------------------------
    def versions(self) -> list[int]:
        """The complete versions on disk (a build in progress is not one until its record exists)."""
        found = []
        for child in self.directory.iterdir():
            if child.name.isdigit() and (child / ENGINE_DIR / ENGINE_RECORD).is_file():
                found.append(int(child.name))
        return sorted(found)

    def record(self, version: int) -> dict[str, Any]:
        """The engine record of a version: engine_config.json (source, checkpoint hash, flags, versions)."""
        path = self.engine_dir(version) / ENGINE_RECORD
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelStoreError(f"model {self.name!r} version {version}: cannot read {path}: {exc}") from None

    def state(self) -> dict[str, int | None]:
        try:
            raw = json.loads((self.directory / STATE_FILE).read_text())
            return {"live": int(raw["live"]), "previous": None if raw.get("previous") is None else int(raw["previous"])}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelStoreError(f"model {self.name!r}: cannot read {self.directory / STATE_FILE}: {exc}") from None

    @property
    def live_version(self) -> int:
        return int(self.state()["live"])  # type: ignore[arg-type]

    @property
    def previous_version(self) -> int | None:
        return self.state()["previous"]

    def loaded_versions(self) -> list[int]:
        """The versions config.pbtxt asks Triton to keep loaded."""
        match = _POLICY_LINE.search(self.config_path.read_text())
        if match is None:
            raise ModelStoreError(f"{self.config_path} has no version_policy line")
        return sorted(int(v) for v in re.findall(r"\d+", match.group(0)))

    def live_link_target(self) -> int | None:
        try:
            target = os.readlink(self.live_link)
        except OSError:
            return None
        return int(target) if target.isdigit() else None

    # ----- changes ----------------------------------------------------------------------------------
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the model's lock, across processes (flock on `.lock`): the build's placing and pruning of
        versions and the rollout's edits of policy, link and state take it, for a few file operations each,
        never across a build or a load. Not re-entrant: a holder must not call prune() or settle()."""
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def set_loaded(self, versions: list[int]) -> None:
        """Rewrite config.pbtxt's version_policy (atomically: Triton may read it at any moment)."""
        text = self.config_path.read_text()
        write_atomically(self.config_path, _POLICY_LINE.sub(version_policy_line(versions), text, count=1))

    def point_live_link(self, version: int) -> None:
        """Point `live` at version N, replacing the link in one rename (never absent, never half made)."""
        staging = self.directory / f".{LIVE_LINK}.tmp"
        if staging.is_symlink() or staging.exists():
            staging.unlink()
        os.symlink(str(version), staging)
        os.replace(staging, self.live_link)

    def commit(self, live: int, previous: int | None) -> None:
        write_atomically(self.directory / STATE_FILE, json.dumps({"live": live, "previous": previous}) + "\n")

    def settle(self) -> str | None:
        """Make the policy and the link agree with the state file (an interrupted rollout leaves two
        versions in the policy, or the link on a version that never went live); what was repaired, or None."""
        with self.locked():
            return self._settle()

    def _settle(self) -> str | None:
        live = self.live_version
        repaired = []
        if self.loaded_versions() != [live]:
            repaired.append(f"version_policy {self.loaded_versions()} -> [{live}]")
            self.set_loaded([live])
        if self.live_link_target() != live:
            repaired.append(f"link {LIVE_LINK} -> {live}")
            self.point_live_link(live)
        return ", ".join(repaired) or None

    def prune(self, keep: int) -> list[int]:
        """Delete the oldest versions beyond `keep`, never the live one, the rollback target nor the newest
        (just built, not rolled out yet): so up to three may stay whatever `keep` says. Nor any version the
        version_policy or the `live` link names: a rollout in progress loads it (or is unloading it).

        Under the model's lock, the versions chosen are renamed out of the way (`.pruned-N`: no longer a
        version, for Triton or a rollout); the slow deletion runs after the lock is released."""
        with self.locked():
            state = self.state()
            versions = self.versions()
            protected = {state["live"], state["previous"], max(versions, default=None), self.live_link_target(),
                         *self.loaded_versions()}
            removable = [v for v in versions if v not in protected]
            excess = len(versions) - max(keep, 1)
            removed = removable[:max(excess, 0)]
            doomed = []
            for version in removed:
                target = self.directory / f".pruned-{version}"
                if target.exists():  # left by a prune that was interrupted
                    shutil.rmtree(target)
                self.version_dir(version).rename(target)
                doomed.append(target)
        for target in doomed:
            shutil.rmtree(target, ignore_errors=True)
        return removed


def managed_models(repository: Path) -> list[ManagedModel]:
    """The named models of a repository: every model directory with a rollout state file."""
    repository = Path(repository)
    if not repository.is_dir():
        return []
    return [ManagedModel(child) for child in sorted(repository.iterdir())
            if child.is_dir() and (child / STATE_FILE).is_file()]


def find_model(repository: Path, name: str) -> ManagedModel:
    for model in managed_models(repository):
        if model.name == name:
            return model
    served = ", ".join(m.name for m in managed_models(repository)) or "none"
    raise ModelStoreError(f"no model {name!r} in {repository} (models there: {served})")

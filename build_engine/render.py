"""Strict rendering of the model repository templates (``config.pbtxt`` files with ``${name}`` placeholders).

Strict both ways: a placeholder left unfilled would reach tritonserver as literal ``${...}`` and fail (or,
worse, parse) far from its cause, and a value no template uses is almost always a misspelt key.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from build_engine.errors import BuildError

CONFIG_FILE = "config.pbtxt"
# Directories beside the models that are not models themselves.
NON_MODEL_DIRS = frozenset({"values"})
COPY_IGNORE = shutil.ignore_patterns("__pycache__", ".gitkeep")
PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Values land inside quoted protobuf text strings; these characters would break or alter that text.
FORBIDDEN_VALUE_CHARS = ('"', "\\", "\n", "\r")


class RenderError(BuildError):
    """The templates and values do not match, or the output location is unsafe."""


def model_templates(template_dir: Path) -> list[Path]:
    """The model directories of a template repository: every subdirectory holding a config.pbtxt."""
    return sorted(
        child
        for child in Path(template_dir).iterdir()
        if child.is_dir() and child.name not in NON_MODEL_DIRS and (child / CONFIG_FILE).is_file()
    )


def template_placeholders(template_dir: Path) -> dict[Path, set[str]]:
    """Placeholder names used by each template config.pbtxt."""
    return {
        model / CONFIG_FILE: set(PLACEHOLDER.findall((model / CONFIG_FILE).read_text()))
        for model in model_templates(template_dir)
    }


def render_repository(template_dir: Path, values: Mapping[str, str], out_dir: Path) -> None:
    """Render ``template_dir`` into ``out_dir`` (wiped first), filling every ``${name}`` from ``values``.

    Everything is checked before anything is written, so a failed render leaves no half-filled repository.
    """
    template_dir = Path(template_dir).resolve()
    out_dir = Path(out_dir).resolve()
    _check_locations(template_dir, out_dir)
    models = model_templates(template_dir)
    if not models:
        raise RenderError(f"{template_dir} holds no model directories (none has a {CONFIG_FILE})")
    _check_values(values, template_placeholders(template_dir))

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    for model in models:
        target = out_dir / model.name
        shutil.copytree(model, target, ignore=COPY_IGNORE)
        config = target / CONFIG_FILE
        config.write_text(PLACEHOLDER.sub(lambda match: values[match.group(1)], config.read_text()))


def stale_copies(template_dir: Path, out_dir: Path) -> list[Path]:
    """The files of a rendered repository that are no longer what the templates would copy there (every
    file but the filled-in configs): a repository rendered before an upgrade carries the old model code."""
    template_dir = Path(template_dir).resolve()
    stale = []
    for model in model_templates(template_dir):
        for source in sorted(model.rglob("*")):
            if (not source.is_file() or source.name in (CONFIG_FILE, ".gitkeep")
                    or "__pycache__" in source.relative_to(model).parts):
                continue
            copy = Path(out_dir) / source.relative_to(template_dir)
            if not copy.is_file() or copy.read_bytes() != source.read_bytes():
                stale.append(copy)
    return stale


def _check_locations(template_dir: Path, out_dir: Path) -> None:
    if not template_dir.is_dir():
        raise RenderError(f"template directory {template_dir} does not exist")
    # out_dir is wiped, so it must neither be, sit inside, nor contain the templates.
    if out_dir == template_dir or template_dir in out_dir.parents or out_dir in template_dir.parents:
        raise RenderError(
            f"refusing to render into {out_dir}: it overlaps the template directory {template_dir}; "
            "render into a build folder instead"
        )


def _check_values(values: Mapping[str, str], placeholders: dict[Path, set[str]]) -> None:
    problems: list[str] = []
    for config, names in sorted(placeholders.items()):
        problems.extend(
            f"unfilled placeholder ${{{name}}} in {config}" for name in sorted(names - values.keys())
        )
    used = set().union(*placeholders.values())
    problems.extend(
        f"value {key!r} is used by no template (misspelt?)" for key in sorted(values.keys() - used)
    )
    for key, value in sorted(values.items()):
        if not isinstance(value, str):
            problems.append(f"value {key!r} must be a string, got {type(value).__name__} {value!r}")
        elif any(char in value for char in FORBIDDEN_VALUE_CHARS):
            problems.append(f"value {key!r} = {value!r} contains a quote, backslash or newline")
    if problems:
        raise RenderError("cannot render the model repository:\n  " + "\n  ".join(problems))

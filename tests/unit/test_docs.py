"""The documentation: the generated configuration reference covers every setting, and the README stays short,
starts with the two commands and links only to docs pages that exist (the site itself: `make lint`)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SOURCE_DIRS = ("frontend", "launcher", "build_engine", "cpu_engine", "benchmarks", "model_repository")


def _reference_module():
    spec = importlib.util.spec_from_file_location("settings_reference", ROOT / "docs" / "settings_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_settings_class_is_in_the_reference():
    """Every pydantic-settings class in the source is one the reference renders."""
    declared = set()
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ClassDef) and any(
                        getattr(base, "id", getattr(base, "attr", None)) == "BaseSettings" for base in node.bases):
                    declared.add(node.name)
    rendered = {cls.__name__ for cls in _reference_module().SETTINGS_CLASSES}
    assert declared and declared <= rendered, f"settings classes missing from docs/settings_reference.py: " \
                                              f"{sorted(declared - rendered)}"


def test_every_field_appears_in_the_generated_reference():
    reference = _reference_module()
    table = reference.render()
    rows = {line.split(" | ")[0].strip("| `") for line in table.splitlines() if line.startswith("| `")}
    for cls in reference.SETTINGS_CLASSES:
        for name, field in cls.model_fields.items():
            assert name.upper() in rows, f"{cls.__name__}.{name} is not in the configuration reference"
            assert field.description, f"{cls.__name__}.{name} has no description for the reference"
    # The page carries the marker the build replaces with the table, and the hook replaces that marker.
    marker = "<!-- settings-reference -->"
    assert marker in (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert marker in (ROOT / "docs" / "hooks" / "site.py").read_text(encoding="utf-8")


def test_reference_row_shape():
    """Env name, flag (or environment only for secrets), type, default, description."""
    rows = {row[0]: row for row in _reference_module().rows(_reference_module().SETTINGS_CLASSES[0])}
    assert rows["`FRONTEND_PORT`"][1:4] == ("`--frontend-port`", "`int`", "`9000`")
    assert rows["`API_KEYS`"][1] == "environment only"
    assert rows["`SERVED_MODEL_NAME`"][3] == "none"


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150: the rest belongs in docs/)"
    first_block = lines.index("```")
    commands = [line.split("#")[0].strip() for line in lines[first_block + 1:first_block + 3]]
    assert commands == ["make serve", "make test"]
    # Nothing before it but the title and the one-paragraph description.
    assert not any(line.startswith(("##", "```", "    ")) for line in lines[1:first_block])


@pytest.mark.parametrize("target", sorted({
    link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", README.read_text(encoding="utf-8"))
    if not re.match(r"[a-z]+:", link) and not link.startswith("#")}))
def test_readme_links_resolve(target):
    assert (ROOT / target).is_file(), f"README.md links to {target}, which does not exist"


def test_readme_links_into_docs():
    links = re.findall(r"\]\((docs/[^)\s#]+)", README.read_text(encoding="utf-8"))
    pages = {path.relative_to(ROOT).as_posix() for path in (ROOT / "docs").glob("*.md")} - {"docs/index.md"}
    assert links and pages <= set(links), f"docs pages the README does not link: {sorted(pages - set(links))}"


def test_nav_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for path in (ROOT / "docs").glob("*.md"):
        assert f": {path.name}" in nav, f"docs/{path.name} is not in mkdocs.yml's nav"

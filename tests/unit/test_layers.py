"""The frontend's packages are its layers, and imports only go down them (README, "Layout").

A module may import its own package and the packages below it, never one above: a request's walk goes from
the HTTP edge down to the wire types without coming back up. Imports inside functions and TYPE_CHECKING
blocks count too: a cycle hidden in a function is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

FRONTEND = Path(__file__).resolve().parents[2] / "frontend"
# Top first. `frontend/__main__.py`, the server module and the settings module sit where their imports put them.
LAYERS = ["__main__", "server", "http", "responses_api", "workers", "planning", "models", "settings", "generation", "parsing", "text",
          "policy", "observability", "api_types"]
# Beside each other, never importing each other: the same rank.
RANK = {name: index for index, name in enumerate(LAYERS)}
RANK["observability"] = RANK["policy"]


def layer_of(module: str) -> str:
    """`frontend.http.routes` -> `http`; `frontend.settings` -> `settings`."""
    parts = module.split(".")
    assert parts[0] == "frontend" and len(parts) >= 2, module
    return parts[1]


def frontend_imports(path: Path) -> set[str]:
    """Every `frontend...` module the file imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "frontend":
            if node.module == "frontend":
                found.update(f"frontend.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "frontend")
    return found


def module_name(path: Path) -> str:
    relative = path.relative_to(FRONTEND.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = sorted(p for p in FRONTEND.rglob("*.py") if p.name != "__init__.py" or p.parent != FRONTEND)


def test_every_module_belongs_to_a_known_layer() -> None:
    assert {layer_of(module_name(p)) for p in MODULES} == set(LAYERS)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(FRONTEND)))
def test_imports_go_down_the_layers(path: Path) -> None:
    own = layer_of(module_name(path))
    upward = sorted(m for m in frontend_imports(path) if RANK[layer_of(m)] < RANK[own]
                    or (RANK[layer_of(m)] == RANK[own] and layer_of(m) != own))
    assert not upward, f"{module_name(path)} ({own}) imports from above or beside its layer: {upward}"

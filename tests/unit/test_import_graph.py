"""cpu_engine's modules import each other without cycles: every `import` of a cpu_engine module counts,
also those under `if TYPE_CHECKING:` and inside functions, so a cycle cannot hide behind a lazy import."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = "cpu_engine"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
MODULES = sorted(path.stem for path in ROOT.glob("*.py") if path.stem != "__init__")


def imported_modules(module: str) -> set[str]:
    """The cpu_engine modules `module` imports anywhere in its source."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / f"{module}.py").read_text(), f"{module}.py")):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (f"{PACKAGE}.{node.module}" if node.module else PACKAGE) if node.level else node.module or ""
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]  # `from cpu_engine import x`
        else:
            continue
        found.update(name.split(".")[1] for name in names
                     if name.startswith(PACKAGE + ".") and name.split(".")[1] in MODULES)
    return found - {module}


def test_the_graph_is_read() -> None:
    assert {"scheduler", "guided", "sampling", "guide_pool", "types", "kv_blocks"} <= set(MODULES)
    assert "types" in imported_modules("guided") and "sampling" in imported_modules("scheduler")
    assert "guided" in imported_modules("scheduler")  # TYPE_CHECKING and function-level imports count


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = {module: imported_modules(module) for module in MODULES}

    def reaches(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        return seen

    back = {module: sorted(target for target in graph[module] if module in reaches(target)) for module in MODULES}
    assert not {module: targets for module, targets in back.items() if targets}, f"imports back: {back}"


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports(module: str) -> None:
    importlib.import_module(f"{PACKAGE}.{module}")

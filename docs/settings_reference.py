"""The configuration reference: one Markdown table of every settings field, made from the pydantic models.

`make docs` runs it (through the MkDocs hook docs/hooks/site.py, with the project's venv, which has pydantic and
the frontend), so the table in docs/configuration.md is rebuilt from the code on every build and is never out of
date; tests/unit/test_docs.py checks that every field appears. Run alone: `python docs/settings_reference.py`.
"""

from __future__ import annotations

import re
import sys
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic_settings import BaseSettings  # noqa: E402

from frontend.settings import Settings  # noqa: E402

# Every settings class of the project (a pydantic-settings BaseSettings): each gets its section in the table.
# tests/unit/test_docs.py fails if a BaseSettings subclass in the source is missing here.
SETTINGS_CLASSES: tuple[type[BaseSettings], ...] = (Settings,)


def _type_name(annotation: object) -> str:
    text = annotation.__name__ if isinstance(annotation, type) else repr(annotation)
    text = re.sub(r"\b(?:typing|pathlib|frontend(?:\.\w+)*|pydantic(?:\.\w+)*)\.", "", text)
    return text.replace("NoneType", "None").replace("Optional[", "None | [")


def _env_only(field) -> bool:
    """CliSuppress fields (secrets): the environment only, never a flag."""
    return any("CLI_SUPPRESS" in repr(item) or "CliSuppress" in repr(item) or item == "==SUPPRESS=="
               for item in field.metadata)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def rows(cls: type[BaseSettings]) -> list[tuple[str, str, str, str, str]]:
    """(environment variable, CLI flag, type, default, description) of each field, in declaration order."""
    out = []
    for name, field in cls.model_fields.items():
        env = (field.alias or name).upper()
        flag = "environment only" if _env_only(field) else "`--" + name.replace("_", "-") + "`"
        default = field.get_default(call_default_factory=True)
        default_text = "none" if default is None else f"`{default}`"
        out.append((f"`{env}`", flag, f"`{_type_name(field.annotation)}`", default_text,
                    field.description or ""))
    return out


def render() -> str:
    parts = []
    for cls in SETTINGS_CLASSES:
        parts.append(f"### `{cls.__module__}.{cls.__qualname__}`\n")
        if cls.__doc__:
            parts.append(typing.cast(str, cls.__doc__).strip() + "\n")
        parts.append("| environment variable | CLI flag | type | default | description |")
        parts.append("|---|---|---|---|---|")
        for row in rows(cls):
            parts.append("| " + " | ".join(_cell(cell) for cell in row) + " |")
        parts.append("")
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(render())

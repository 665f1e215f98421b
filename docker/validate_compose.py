"""`make lint`: docker/compose.yaml against the Compose Specification's JSON schema, offline, installing nothing.

    python docker/validate_compose.py docker/compose.yaml      (the project venv: PyYAML and jsonschema)

The schema is vendored: docker/compose-spec/compose-spec.json, schema/compose-spec.json of
github.com/compose-spec/compose-spec at commit a08f8d51631b7127ddac3d2c65537db429d0f1d0 (Apache-2.0, see
docker/compose-spec/README.md), the schema `docker compose config` validates against. The file is read as
Compose reads it: YAML (merge keys included), then variables interpolated from the environment (`$$`,
`$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?error}`, `${VAR?error}`, `${VAR:+alt}`,
`${VAR+alt}`), so a required variable that is unset fails here as it fails `docker compose`.
tests/integration/test_deploy_contract.py reads the frontend service through `load()`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import yaml

SCHEMA = Path(__file__).resolve().parent / "compose-spec" / "compose-spec.json"
_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|\{(?P<braced>[^}]*)\})")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", re.S)


class ComposeError(ValueError):
    pass


def interpolate(value: str, environ: Mapping[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["name"]:
            return environ.get(match["name"], "")
        braced = _BRACED.fullmatch(match["braced"])
        if braced is None:
            raise ComposeError(f"invalid interpolation: {match.group(0)!r}")
        name, op, arg = braced["name"], braced["op"], braced["arg"] or ""
        is_set = name in environ
        is_nonempty = bool(environ.get(name))
        present = is_nonempty if op and op.startswith(":") else is_set
        if op is None:
            return environ.get(name, "")
        if op.endswith("-"):
            return environ[name] if present else interpolate(arg, environ)
        if op.endswith("?"):
            if not present:
                raise ComposeError(f"required variable {name} is missing a value: {arg}")
            return environ[name]
        return interpolate(arg, environ) if present else ""  # `+`

    return _VARIABLE.sub(one, value)


def _walk(node: Any, environ: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, environ)
    if isinstance(node, list):
        return [_walk(item, environ) for item in node]
    if isinstance(node, dict):
        return {key: _walk(value, environ) for key, value in node.items()}
    return node


def load(path: Path | str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file as Compose models it before defaults: parsed, interpolated, validated."""
    with open(path, encoding="utf-8") as handle:
        raw = yaml.safe_load(handle)
    model = _walk(raw, os.environ if environ is None else environ)
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(model), key=lambda e: list(e.absolute_path))
    if errors:
        raise ComposeError("\n".join(f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                                     for e in errors))
    return model


def main(paths: list[str]) -> int:
    failed = 0
    for path in paths:
        try:
            model = load(path)
        except (ComposeError, yaml.YAMLError) as exc:
            print(f"{path}: {exc}")
            failed += 1
        else:
            print(f"{path}: valid ({len(model.get('services', {}))} services)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""docker/compose.yaml, read as Compose reads it (docker/validate_compose.py: the vendored Compose
Specification schema, compose's interpolation): `make lint`'s check refuses what Compose refuses, and the
frontend's store is the compose PostgreSQL, its password a secret file, and its workers share reasoning keys
from another. tests/integration/
test_deploy_contract.py starts the frontend as declared here."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "compose.yaml"
ENV = {"MODEL_DIR": "/models/hf", "RESPONSES_DB_PASSWORD_FILE": "/run/pw", "RESPONSES_REASONING_KEYS_FILE": "/run/rk"}


def validate_compose():
    spec = importlib.util.spec_from_file_location("validate_compose", REPO / "docker" / "validate_compose.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_interpolation_follows_compose() -> None:
    v = validate_compose()
    env = {"SET": "x", "EMPTY": ""}
    assert v.interpolate("$$SET ${SET} $SET ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} ${SET:+a} ${UNSET+a}", env) == "$SET x x d d  a "
    with pytest.raises(v.ComposeError, match="need it"):
        v.interpolate("${EMPTY:?need it}", env)


def test_the_schema_refuses_what_compose_refuses(tmp_path: Path) -> None:
    v = validate_compose()
    model = yaml.safe_load(COMPOSE.read_text())
    model["services"]["frontend"]["read_onyl"] = True  # a typo
    bad = tmp_path / "compose.yaml"
    bad.write_text(yaml.safe_dump(model))
    with pytest.raises(v.ComposeError, match="read_onyl"):
        v.load(bad, ENV)
    with pytest.raises(v.ComposeError, match="MODEL_DIR"):
        v.load(COMPOSE, {})


def test_frontend_stores_responses_in_the_compose_postgresql() -> None:
    model = validate_compose().load(COMPOSE, ENV)
    frontend, db = model["services"]["frontend"], model["services"]["responses-db"]
    match = re.fullmatch(r"postgresql://(\w+)@([\w-]+):5432/(\w+)", frontend["environment"]["RESPONSES_DB_URL"])
    assert match and match.group(2) == "responses-db"
    assert (db["environment"]["POSTGRES_USER"], db["environment"]["POSTGRES_DB"]) == (match.group(1), match.group(3))
    assert re.fullmatch(r"postgres:\d+\.\d+-\w+(@sha256:[0-9a-f]{64})?", db["image"])
    assert set(db["networks"]) == {"responses"} and "ports" not in db and model["networks"]["responses"]["internal"]
    assert {name for name, s in model["services"].items() if "responses" in (s.get("networks") or ())} == \
        {"frontend", "responses-db"}
    assert frontend["depends_on"]["responses-db"]["condition"] == "service_healthy"
    # The password: one secret file, read by both; never a literal, never an env value of this file.
    assert model["secrets"]["responses_db_password"]["file"] == ENV["RESPONSES_DB_PASSWORD_FILE"]
    assert db["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/responses_db_password"
    # The frontend reads the file itself and runs the image's own command (no shell wrapper).
    assert frontend["environment"]["RESPONSES_DB_PASSWORD_FILE"] == "/run/secrets/responses_db_password"
    assert "command" not in frontend and "entrypoint" not in frontend
    assert not any("PASSWORD" in k and not k.endswith("_FILE") for s in model["services"].values()
                   for k in (s.get("environment") or {}))
    # Nothing written outside /tmp.
    assert frontend["read_only"] is True and frontend["tmpfs"] == ["/tmp"]


def test_frontend_workers_share_reasoning_keys_from_a_secret_file() -> None:
    """Sealed reasoning (encrypted_content) made by one worker must open in any other: a key file shared by
    all, never the per-process key a PostgreSQL store would otherwise get."""
    v = validate_compose()
    model = v.load(COMPOSE, ENV)
    frontend = model["services"]["frontend"]
    assert model["secrets"]["responses_reasoning_keys"]["file"] == ENV["RESPONSES_REASONING_KEYS_FILE"]
    assert "responses_reasoning_keys" in frontend["secrets"]
    assert frontend["environment"]["RESPONSES_REASONING_KEYS_FILE"] == "/run/secrets/responses_reasoning_keys"
    assert "RESPONSES_REASONING_KEYS" not in frontend["environment"]
    with pytest.raises(v.ComposeError, match="RESPONSES_REASONING_KEYS_FILE"):
        v.load(COMPOSE, {k: v for k, v in ENV.items() if k != "RESPONSES_REASONING_KEYS_FILE"})

"""Settings layering: flags > RELEASEKIT_* environment > releasekit.toml > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.config import load_settings
from releasekit.errors import ConfigError


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import os

    for key in list(os.environ):
        if key.startswith("RELEASEKIT_") or key == "MLFLOW_TRACKING_URI":
            monkeypatch.delenv(key)
    monkeypatch.setenv("RELEASEKIT_ROOT", str(tmp_path))
    return tmp_path


def test_defaults_are_embedded_stores_under_the_root(clean_env: Path) -> None:
    s = load_settings()
    assert s.root == clean_env.resolve()
    assert s.mlflow_tracking_uri == f"sqlite:///{clean_env.resolve()}/.releasekit/mlflow.db"
    assert s.ledger_url == f"sqlite:///{clean_env.resolve()}/.releasekit/ledger.db"
    assert s.release_dir("abc") == clean_env.resolve() / "results" / "abc"


def test_toml_then_env_then_flags(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (clean_env / "releasekit.toml").write_text(
        'ledger_url = "sqlite:////tmp/from-toml.db"\nactor = "toml"\nserver_start_timeout_s = 12\n'
    )
    s = load_settings()
    assert (s.ledger_url, s.actor, s.server_start_timeout_s) == (
        "sqlite:////tmp/from-toml.db",
        "toml",
        12,
    )
    monkeypatch.setenv("RELEASEKIT_ACTOR", "env")
    assert load_settings().actor == "env"
    assert load_settings(actor="flag").actor == "flag"


def test_mlflow_tracking_uri_convention_is_honoured(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert load_settings().mlflow_tracking_uri == "http://127.0.0.1:5999"


def test_invalid_settings_list_each_field(clean_env: Path) -> None:
    (clean_env / "releasekit.toml").write_text("server_start_timeout_s = -1\nbogus = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "server_start_timeout_s" in str(info.value) and "bogus" in str(info.value)


def test_malformed_toml_is_a_config_error(clean_env: Path) -> None:
    (clean_env / "releasekit.toml").write_text("this is = = not toml\n")
    with pytest.raises(ConfigError):
        load_settings()


def test_cli_version_and_unknown_error_path() -> None:
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("releasekit ")

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


def test_environment_policy_defaults_and_bounds(clean_env: Path) -> None:
    """The embedded policy defaults hold where an environment names none (a table that
    names some suites keeps the defaults for the rest); a floor or ceiling outside 0..1 is
    a settings error naming the field."""
    (clean_env / "releasekit.toml").write_text(
        "[environments.staging]\nport = 8780\n"
        'min_pass_rate = { core = 0.9, "*" = 0.5 }\nmax_margin = { facts = 0.01 }\n'
        "max_perf_tolerance = { goodput = 0.05 }\n"
    )
    cfg = load_settings().environments["staging"]
    assert (cfg.floor_for("core"), cfg.floor_for("edge")) == (0.9, 0.5)
    assert (cfg.margin_ceiling("facts"), cfg.margin_ceiling("core")) == (0.01, 0.10)
    assert cfg.tolerance_ceiling("goodput") == 0.05
    assert (cfg.tolerance_ceiling("ttft_p95_s"), cfg.tolerance_ceiling("tpot_p95_s")) == (0.5, 0.5)
    assert cfg.max_perf_spread == 0.25 and set(cfg.policy()) >= {"min_pass_rate", "perf_by_canary"}
    bare = load_settings(environments={"production": {"port": 8781}}).environments["production"]
    assert bare.floor_for("core") is None and bare.margin_ceiling("core") == 0.10

    (clean_env / "releasekit.toml").write_text(
        "[environments.staging]\nport = 8780\nmax_margin = { core = 1.5 }\n"
    )
    with pytest.raises(ConfigError, match=r"environments\.staging\.max_margin"):
        load_settings()

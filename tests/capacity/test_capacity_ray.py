"""`releasekit capacity --env ENV`: the plan's units as a ray environment's replicas and
the promote command that applies them; refused for an environment on another target."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from releasekit.capacity.replicas import PlannedReplicas
from releasekit.cli import capacity_cmds
from releasekit.cli._common import State

HAND = [
    "capacity",
    "--daily-requests", "100000", "--peak-hours", "2", "--peak-factor", "2",
    "--concurrency", "16", "--tokens-per-second", "30", "--output-tokens", "200",
]  # fmt: skip


@pytest.fixture
def ray_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A project whose staging runs on a Ray cluster (2 CPUs a replica), production local."""
    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    toml = tmp_path / "releasekit.toml"
    toml.write_text(
        '[environments.staging]\nport = 8780\ntarget = "ray"\n'
        'ray = { address = "127.0.0.1:6390", replicas = 2, cpus_per_replica = 2 }\n'
        "[environments.production]\nport = 8781\n"
    )
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(toml))
    monkeypatch.chdir(tmp_path)
    return toml


def _run(*args: str) -> tuple[int, str, str]:
    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        State.reset()

    capacity_cmds.register(app)
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.stdout, res.stderr


def test_the_units_are_printed_as_replicas_with_the_command_that_applies_them(
    ray_env: Path,
) -> None:
    """The worked example's 12 units are 12 replicas, 24 Ray CPUs, and `promote --replicas
    12`."""
    code, out, _ = _run(*HAND, "--env", "staging")
    assert code == 0, out
    assert "12 replica(s) x 2 CPU = 24 Ray CPUs" in out
    assert "releasekit promote RELEASE --to staging --replicas 12" in out
    code, out, _ = _run(*HAND, "--env", "staging", "--json")
    assert code == 0, out
    planned = PlannedReplicas.model_validate_json(out)
    assert planned.replicas.replicas == planned.plan.units == 12
    assert planned.replicas.configured_replicas == 2


def test_an_environment_on_another_target_is_refused(ray_env: Path) -> None:
    """production runs on `local`: one error line, exit 1."""
    code, _out, err = _run(*HAND, "--env", "production")
    assert code == 1
    assert "production is on target local" in err


def test_the_plan_implies_an_autoscaling_range_from_the_mean_and_the_peak(
    ray_env: Path,
) -> None:
    """The worked example: the day's mean rate (100,000 / 86,400 s = 1.16 req/s) needs 1
    replica, the peak (27.8 req/s) 12: range 1-12, printed beside the environment's own
    range (1-4), which the plan's peak outgrows (a warning)."""
    ray_env.write_text(
        ray_env.read_text().replace(
            "cpus_per_replica = 2 }",
            'cpus_per_replica = 2, autoscaling = { target = "knee", knee_headroom = 0.25, '
            "min_replicas = 1, max_replicas = 4 } }",
        )
    )
    code, out, _ = _run(*HAND, "--env", "staging")
    assert code == 0, out
    flat = " ".join(out.split())
    assert "autoscaling range 1-12 replicas (mean 1.16 req/s -> 1, peak 27.8 req/s -> 12" in flat
    assert "releasekit.toml: 1-4" in flat
    assert "autoscales up to 4 replicas, fewer than the plan's 12" in flat
    code, out, _ = _run(*HAND, "--env", "staging", "--json")
    rng = PlannedReplicas.model_validate_json(out).replicas.autoscaling
    assert (rng.min_replicas, rng.max_replicas, rng.configured) == (1, 12, "1-4")

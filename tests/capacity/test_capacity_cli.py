"""`releasekit capacity` through typer's CliRunner: the working printed, --json, the plot,
the roofline, and one clear line for bad input."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from releasekit.capacity import CapacityPlan, Roofline
from releasekit.cli import capacity_cmds
from releasekit.cli._common import State
from releasekit.config import Settings

runner = CliRunner()
HAND = [
    "capacity",
    "--daily-requests", "100000", "--peak-hours", "2", "--peak-factor", "2",
    "--concurrency", "16", "--tokens-per-second", "30", "--output-tokens", "200",
]  # fmt: skip
TRAFFIC = ["--daily-requests", "1000000", "--peak-hours", "4", "--peak-factor", "2"]


def _app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        State.reset()

    capacity_cmds.register(app)
    return app


def _run(*args: str) -> tuple[int, str, str]:
    res = runner.invoke(_app(), list(args))
    return res.exit_code, res.stdout, res.stderr


def test_worked_example_prints_every_step() -> None:
    """By hand, the table shows 27.8 req/s, 6.67 s, 2.40 req/s per unit, ceil(11.57), 12
    units and 96.5% utilisation."""
    code, out, _ = _run(*HAND)
    assert code == 0, out
    for text in (
        "100,000 requests / (2 h x 3600 s) x 2",
        "27.8 req/s",
        "0 s + 200 tokens / 30 tokens/s",
        "6.67 s",
        "16 concurrent / 6.67 s",
        "2.40 req/s per unit",
        "ceil(27.8 x 1 / 2.40) = ceil(11.57)",
        "12 units",
        "96.5%",
    ):
        assert text in out, text
    assert "warning:" in out and "nothing here was measured" in out


def test_json_is_the_plan_model() -> None:
    """--json prints a CapacityPlan that validates, with its steps and warnings."""
    code, out, _ = _run(*HAND, "--unit-cost-per-hour", "3", "--json")
    assert code == 0, out
    plan = CapacityPlan.model_validate_json(out)
    assert plan.units == 12 and plan.cost_per_hour == pytest.approx(36.0)
    data = json.loads(out)
    assert {"peak_requests_per_s", "unit", "units", "utilisation", "steps", "warnings"} <= set(data)
    assert data["unit"]["source"] == "by hand"


def test_hand_plot_is_written_as_png(tmp_path: Path) -> None:
    """--plot PATH writes a PNG of units against daily volume."""
    path = tmp_path / "plots" / "plan.png"
    code, out, _ = _run(*HAND, "--plot", str(path))
    assert code == 0, out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path}" in out


def test_release_plan_from_cli_writes_plot_next_to_results(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """`capacity <id prefix>` plans from the release's bench (9 units, Little 16 = measured
    16 req/s) and writes results/<id>/capacity.png; --no-plot writes none."""
    rdir = write_release()
    code, out, err = _run("capacity", release_id[:10], *TRAFFIC, "--json")
    assert code == 0, out + err
    plan = CapacityPlan.model_validate_json(out)
    assert plan.release_id == release_id and plan.units == 9
    assert plan.unit.little_over_measured == pytest.approx(1.0)
    assert plan.plot == str(rdir / "capacity.png")
    assert (rdir / "capacity.png").read_bytes()[:4] == b"\x89PNG"
    (rdir / "capacity.png").unlink()
    code, out, _ = _run("capacity", release_id, *TRAFFIC, "--no-plot", "--prompt-tokens", "400")
    assert code == 0 and not (rdir / "capacity.png").exists()
    assert "16 req/s / 16 req/s measured at the knee = 1.000" in out
    assert "Little / measured" in out
    assert "warning:" in out and "prompt tokens" in out


def test_roofline_by_hand_prints_about_14_tokens_per_s() -> None:
    """The issue's command prints 14.3 tokens/s per sequence; 1 byte per weight prints 28.6."""
    code, out, _ = _run(
        "capacity", "--roofline", "--params", "70e9", "--bytes-per-weight", "2",
        "--bandwidth-gbs", "2000",
    )  # fmt: skip
    assert code == 0, out
    assert "14.3 tokens/s per sequence" in out
    code, out, _ = _run(
        "capacity", "--roofline", "--params", "70e9", "--bytes-per-weight", "1",
        "--bandwidth-gbs", "2000", "--json",
    )  # fmt: skip
    assert Roofline.model_validate_json(out).ceiling_tokens_per_s == pytest.approx(28.571, 1e-4)


def test_roofline_of_a_release_from_cli(
    write_release: Callable[..., Path], settings_cap: Settings, release_id: str
) -> None:
    """`capacity <id> --roofline` shows the ceiling beside the measured single stream."""
    write_release(weights_bytes=10_000_000)
    code, out, err = _run("capacity", release_id, "--roofline", "--bandwidth-gbs", "100")
    assert code == 0, out + err
    assert "10,000 tokens/s per sequence" in out
    assert "compute/overhead-bound, not bandwidth-bound" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--daily-requests", "-5"], "--daily-requests must be a positive number (got -5)"),
        (["--peak-hours", "0"], "--peak-hours must be a positive number (got 0)"),
        (["--concurrency", "0"], "--concurrency must be a positive number (got 0)"),
        (["--headroom", "0.5"], "--headroom multiplies the peak rate"),
    ],
)
def test_bad_numbers_give_one_clear_line(args: list[str], message: str) -> None:
    """A bad figure exits 1 with one `error:` line naming the option, no traceback."""
    code, out, err = _run(*HAND, *args)
    assert code == 1
    assert message in err and "Traceback" not in err + out
    assert err.count("error:") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["capacity", "--daily-requests", "1"], "needs --peak-hours, --peak-factor"),
        (["capacity", *TRAFFIC], "give RELEASE, or plan by hand with --concurrency"),
        (["capacity", "--roofline", "--params", "7e9"], "needs --bytes-per-weight"),
        (["capacity", *TRAFFIC, "--params", "7e9"], "need --roofline"),
        (["capacity", "abc123", *TRAFFIC, "--overhead-s", "0.5"], "not both"),
        (["capacity", "--roofline", *TRAFFIC], "leave out the traffic"),
    ],
)
def test_missing_or_contradictory_options_are_named(args: list[str], message: str) -> None:
    """Missing figures and mixed-up modes are named in one line."""
    code, _, err = _run(*args)
    assert code == 1 and message in err


def test_unknown_release_is_a_clear_error(settings_cap: Settings) -> None:
    """A release reference that matches nothing exits 1 with the resolver's message."""
    code, _, err = _run("capacity", "deadbeef", *TRAFFIC)
    assert code == 1 and "no release matches" in err


def test_release_without_bench_is_a_clear_error(settings_cap: Settings, release_id: str) -> None:
    """A known release with no bench.json names the missing file and how to make it."""
    (settings_cap.release_dir(release_id)).mkdir(parents=True)
    code, _, err = _run("capacity", release_id, *TRAFFIC)
    assert code == 1 and "has no load test" in err and "releasekit bench" in err

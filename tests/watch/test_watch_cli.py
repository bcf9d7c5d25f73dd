"""`releasekit watch` and `releasekit alert-rules` through typer's CliRunner (and one real
subprocess for SIGTERM), on the project, ledger, deploy state and metrics servers of
test_watch_service.py's `wenv` fixture."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from test_watch_service import WatchEnv, promtool, wenv  # noqa: F401  (wenv: a fixture)
from typer.testing import CliRunner

from releasekit.cli import watch_cmds
from releasekit.cli._common import State


def make_app() -> typer.Typer:
    """A root app with only the watch commands (as releasekit.cli registers them)."""
    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        State.reset()

    watch_cmds.register(app)
    return app


@pytest.fixture
def traffic(wenv: WatchEnv) -> Iterator[None]:  # noqa: F811
    """Steady healthy traffic in the sim (about 200 requests/s) while the test runs."""
    stop = threading.Event()

    def feed() -> None:
        while not stop.is_set():
            wenv.sim.serve(10, ttft=0.05, e2e=0.4)
            stop.wait(0.05)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    yield
    stop.set()
    t.join(timeout=5)


def test_watch_once_judges_every_rule_and_prints_a_json_tick(
    wenv: WatchEnv,  # noqa: F811
    traffic: None,
) -> None:
    """`watch prod --once --json` scrapes twice a window apart, judges each of the live
    release's rules once (healthy traffic: pass), rolls nothing back and exits 0."""
    res = CliRunner().invoke(make_app(), ["watch", "prod", "--once", "--json"])
    assert res.exit_code == 0, res.output
    tick = json.loads(res.stdout)
    assert tick["scraped"] is True and tick["rollback"] is None
    by_rule = {j["rule"]: j for j in tick["judgements"]}
    assert set(by_rule) >= {"ttft_p95_s_absolute", "error_rate_absolute", "slo_error_rate"}
    assert by_rule["ttft_p95_s_absolute"]["verdict"] == "pass"
    assert tick["windows"][0]["release"] == wenv.r1


def test_watch_once_with_the_server_down_exits_1(wenv: WatchEnv) -> None:  # noqa: F811
    """A scrape that fails (vLLM answers 503) is reported and `--once` exits 1."""
    wenv.faults.status["vllm"] = 503
    res = CliRunner().invoke(make_app(), ["watch", "prod", "--once"])
    assert res.exit_code == 1
    assert "scrape failed" in res.output


def test_watch_listen_without_credentials_is_refused(wenv: WatchEnv) -> None:  # noqa: F811
    """--listen with no RELEASEKIT_WEBHOOK_TOKEN (or basic creds) is one error line with the
    remedy: the receiver never runs open."""
    res = CliRunner().invoke(make_app(), ["watch", "prod", "--listen", "127.0.0.1:0"])
    assert res.exit_code == 1
    assert "needs receiver credentials" in res.output and "RELEASEKIT_WEBHOOK_TOKEN" in res.output


def test_alert_rules_writes_files_promtool_accepts(wenv: WatchEnv, tmp_path: Path) -> None:  # noqa: F811
    """`alert-rules prod --out F --alertmanager-out G` writes both files, says to run
    `promtool check rules F`, and promtool accepts F."""
    rules, am = tmp_path / "prod.rules.yml", tmp_path / "am.yml"
    res = CliRunner().invoke(
        make_app(),
        ["alert-rules", "prod", "--out", str(rules), "--alertmanager-out", str(am),
         "--webhook-url", "http://127.0.0.1:27095/alertmanager"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert f"promtool check rules {rules}" in res.output
    assert "http://127.0.0.1:27095/alertmanager" in am.read_text()
    proc = subprocess.run(
        [promtool(), "check", "rules", str(rules)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


_RUN = (
    "import typer, sys; sys.path.insert(0, {tests!r}); "
    "from test_watch_cli import make_app; make_app()(prog_name='releasekit')"
)


def test_watch_stops_cleanly_on_sigterm(wenv: WatchEnv, traffic: None) -> None:  # noqa: F811
    """The long-running `watch prod --json` prints one JSON line per scrape, judges the
    healthy traffic a pass and, on SIGTERM, finishes its tick and exits 0. (On a busy host
    the sim's traffic thread may fall behind, and the first judged windows are rightly
    `no_data`: the test reads ticks until a pass, for up to 60 s of them.)"""
    tests = str(Path(__file__).parent)
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN.format(tests=tests), "watch", "prod", "--json",
         "--interval", "0.2"],
        cwd=wenv.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, str(Path(tests).parent)])},
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(json.loads(line))
            verdicts = [j["verdict"] for j in lines[-1]["judgements"]]
            if "pass" in verdicts or len(lines) >= 300:  # 300 ticks of 0.2 s
                break
        proc.send_signal(signal.SIGTERM)
        _rest, errtext = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, errtext
    seen = [j["verdict"] for t in lines for j in t["judgements"]]
    assert "pass" in seen, seen

"""Ledger benchmark: fill a temporary ledger with 10,000 events, then time the auditor's
queries the way the CLI runs them (a fresh Ledger per call).

    .venv/bin/python benchmarks/ledger_bench.py [--events N] [--repeat R] [--out PATH]

Targets (issue 4): `history --env` and `at` under 200 ms, `ledger verify` under 2 s.
Prints the figures and writes them as JSON (default benchmarks/results/ledger.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _results import RESULTS, write_result
from typer.testing import CliRunner

from releasekit.cli import app
from releasekit.config import load_settings
from releasekit.releases import queries as audit
from releasekit.stores.ledger import Event, EventType, Ledger

TARGETS_MS = {"history_env": 200.0, "at": 200.0, "verify": 2000.0}
ENVS = ("dev", "staging", "canary", "production")


def _events(n: int) -> list[Event]:
    """A plausible mix: builds and registrations, assignments walking releases through the
    environments, failed gates, promotions and the odd rollback."""
    out: list[Event] = []
    live: dict[str, str | None] = dict.fromkeys(ENVS)
    i = 0
    while len(out) < n:
        rid = f"{i:064x}"
        out.append(
            Event(
                type=EventType.BUILD,
                to_release=rid,
                reason="dvc repro",
                evidence={"build": "results/" + rid},
            )
        )
        out.append(
            Event(
                type=EventType.REGISTER,
                to_release=rid,
                reason="registered",
                evidence={
                    "model_name": "demo",
                    "model_version": str(i + 1),
                    "mlflow_run_id": f"{i:032x}",
                },
            )
        )
        for env in ENVS:
            if i % 7 == 3 and env == "production":
                out.append(
                    Event(
                        type=EventType.GATE_FAILED,
                        environment=env,
                        to_release=rid,
                        reason="eval.core.pass_rate fell",
                    )
                )
                continue
            etype = EventType.PROMOTE if env != "dev" else EventType.ASSIGN
            out.append(
                Event(
                    type=etype,
                    environment=env,
                    from_release=live[env],
                    to_release=rid,
                    reason="gates passed",
                    live=True,
                    evidence={"model_name": "demo", "model_version": str(i + 1)},
                )
            )
            live[env] = rid
        if i % 11 == 5 and live["production"]:
            prev = f"{i - 1:064x}"
            out.append(
                Event(
                    type=EventType.ROLLBACK,
                    environment="production",
                    from_release=live["production"],
                    to_release=prev,
                    reason="ttft_p95_s breached for 3 windows",
                    live=True,
                )
            )
            live["production"] = prev
        i += 1
    return out[:n]


def _time(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    fn()  # warm the OS file cache and imports; the figures are for the warm path
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t) * 1000)
    return {"median_ms": round(statistics.median(samples), 2), "max_ms": round(max(samples), 2)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit 1 if any target is missed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULTS / "ledger.json")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ledger-bench-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'ledger.db'}"
        os.environ["RELEASEKIT_LEDGER_URL"] = url
        os.environ["RELEASEKIT_ROOT"] = tmp
        os.environ["RELEASEKIT_CONFIG"] = str(Path(tmp) / "releasekit.toml")
        (Path(tmp) / "releasekit.toml").write_text("")  # a project: the audit queries need one
        settings = load_settings(root=Path(tmp), ledger_url=url, actor="bench <bench@example.com>")

        led = Ledger(url, actor="bench <bench@example.com>")
        evs = _events(args.events)
        t = time.perf_counter()
        for k in range(0, len(evs), 500):
            led.append_many(evs[k : k + 500])
        fill_s = time.perf_counter() - t
        t = time.perf_counter()
        single = 200
        for _ in range(single):
            led.append(Event(type=EventType.BUILD, to_release="f" * 64, reason="single append"))
        append_ms = (time.perf_counter() - t) * 1000 / single
        total = led.count()
        mid = led.records(environment="production", live=True)[len(evs) // 20].time
        rows = len(audit.history(settings, env="production").events)

        def history_env() -> None:
            audit.history(settings, env="production")

        def at() -> None:
            res = audit.at(settings, "production", mid)
            if res.release_id is None:
                raise SystemExit("at() found nothing: the benchmark data is wrong")

        def verify() -> None:
            if not Ledger(url).verify().ok:
                raise SystemExit("verify() failed on an untouched ledger")

        runner = CliRunner()

        def cli_history() -> None:
            res = runner.invoke(app, ["history", "--env", "production", "--json"])
            if res.exit_code != 0:
                raise SystemExit(res.output)

        def cli_at() -> None:
            res = runner.invoke(app, ["at", "production", mid.isoformat(), "--json"])
            if res.exit_code != 0:
                raise SystemExit(res.output)

        figures = {
            "history_env": _time(history_env, args.repeat),
            "at": _time(at, args.repeat),
            "verify": _time(verify, max(3, args.repeat // 2)),
            "cli_history_env_json": _time(cli_history, max(3, args.repeat // 2)),
            "cli_at_json": _time(cli_at, args.repeat),
        }
    ok = all(figures[k]["median_ms"] < v for k, v in TARGETS_MS.items())
    result = {
        "events": total,
        "history_env_rows": rows,
        "fill_s": round(fill_s, 2),
        "single_append_ms": round(append_ms, 2),
        "figures": figures,
        "targets_ms": TARGETS_MS,
        "ok": ok,
    }
    write_result(args.out, result, argv=None if argv is None else [sys.argv[0], *argv])

    print(
        f"ledger benchmark: {total} events (filled in {fill_s:.2f} s; "
        f"single append {append_ms:.2f} ms)"
    )
    for name, f in figures.items():
        target = TARGETS_MS.get(name)
        verdict = "" if target is None else (" ok" if f["median_ms"] < target else " MISSED")
        tgt = f" (target < {target:.0f} ms){verdict}" if target else ""
        print(f"  {name:<22} median {f['median_ms']:>8.2f} ms  max {f['max_ms']:>8.2f} ms{tgt}")
    print(f"  history --env production returns {rows} events")
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

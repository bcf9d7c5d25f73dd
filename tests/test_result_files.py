"""Benchmark result files say where, when and how they were measured, and the documented
figures match them: every benchmarks/results/*.json carries its run fields (host CPU model
and kind, date, commit and dirty flag, command; "unknown" where a file was written without
one, never a guess), every link to a result file from the README or a docs/ page points at
a file that exists, each row of the Benchmarks page's table names its files' host kind and
date, and every benchmark writes through the one writer that records them.
`demo_record.py` keeps the `gate_failed` events the tutorial cites."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks._results import CPU_KINDS, RUN_FIELDS, UNKNOWN, cpu_kind, run_info

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"
DOCS = REPO / "docs"
BENCHMARKS_PAGE = DOCS / "benchmarks.md"
RESULT_FILES = sorted(RESULTS.glob("*.json"))
# A docs/ page links to a result file relative to the site's root (`../` from a folder):
# the site's build adds benchmarks/results/ there.
LINK = re.compile(r"\]\((?:\.\./)*(benchmarks/[^)\s#]+)\)")


def _field(run: dict[str, Any], dotted: str) -> Any:
    value: Any = run
    for part in dotted.split("."):
        assert isinstance(value, dict) and part in value, f"no {dotted}"
        value = value[part]
    return value


def _run(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert isinstance(data.get("run"), dict), f"{path.name} has no run block"
    return data["run"]


def test_there_are_result_files() -> None:
    assert len(RESULT_FILES) >= 10


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_every_result_file_carries_host_date_commit_and_command(path: Path) -> None:
    run = _run(path)
    for dotted in RUN_FIELDS:
        value = _field(run, dotted)
        assert value is not None and value != "", f"{path.name}: run.{dotted} is empty"
    host = run["host"]
    assert host["kind"] in (*CPU_KINDS, UNKNOWN), host["kind"]
    if host.get("cpu_flags"):  # the kind is read off the flags the file recorded
        assert host["kind"] == cpu_kind(host["cpu_flags"]), path.name
    assert run["date"] == UNKNOWN or re.match(r"\d{4}-\d{2}-\d{2}", run["date"]), run["date"]
    commit = run["releasekit_commit"]
    assert commit == UNKNOWN or re.fullmatch(r"[0-9a-f]{40}", commit), commit
    assert run["uncommitted_changes"] in (True, False, UNKNOWN)


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_a_file_written_without_some_run_fields_says_which_commits_hold_it(path: Path) -> None:
    run = _run(path)
    if not any(_field(run, dotted) == UNKNOWN for dotted in RUN_FIELDS):
        return
    in_git = run.get("in_git") or {}
    for which in ("added", "last_changed"):
        assert re.fullmatch(r"[0-9a-f]{40}", in_git[which]["commit"]), (path.name, which)
        assert re.match(r"\d{4}-\d{2}-\d{2}T", in_git[which]["date"]), (path.name, which)
    assert run.get("recorded"), f"{path.name}: say which fields were not recorded"


def test_every_link_into_benchmarks_points_at_an_existing_file() -> None:
    for page in [README, *sorted(DOCS.rglob("*.md"))]:
        links = LINK.findall(page.read_text())
        missing = sorted({link for link in links if not (REPO / link).is_file()})
        assert missing == [], (
            f"{page.relative_to(REPO)} links to files that do not exist: {missing}"
        )
    assert LINK.findall(BENCHMARKS_PAGE.read_text()), "the Benchmarks page cites no file"


def _benchmarks_section() -> str:
    """The Benchmarks page's written table (the generated one follows it)."""
    text = BENCHMARKS_PAGE.read_text()
    return text[: text.index("\n## Every result file\n")]


def test_each_benchmarks_row_names_its_files_host_kind_and_date() -> None:
    rows = [ln for ln in _benchmarks_section().splitlines() if ln.startswith("| `")]
    assert rows
    for row in rows:
        for link in LINK.findall(row):
            if not link.startswith("benchmarks/results/"):
                continue
            run = _run(REPO / link)
            kind, day = run["host"]["kind"], str(run["date"])[:10]
            assert f"{kind}, {day}" in row, f"the row citing {link} must say '{kind}, {day}'"


def test_every_benchmark_with_an_out_file_writes_through_write_result() -> None:
    for script in sorted((REPO / "benchmarks").glob("*.py")):
        text = script.read_text()
        if script.name.startswith("_") or '"--out"' not in text:
            continue
        assert "write_result(" in text, f"{script.name} writes its result without its run block"


def test_run_info_records_this_hosts_kind_commit_and_command() -> None:
    run = run_info(["benchmarks/ledger_bench.py", "--quick"])
    flags: list[str] = []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            flags = line.split(":", 1)[1].split()
            break
    assert run["host"]["kind"] == cpu_kind(flags)
    assert run["command"].endswith("python benchmarks/ledger_bench.py --quick")
    for dotted in RUN_FIELDS:
        assert _field(run, dotted) not in (None, "")


def test_cpu_kinds_follow_the_kernel_families() -> None:
    assert cpu_kind(["avx2", "fma"]) == "avx2"
    assert cpu_kind(["avx2", "avx512f"]) == "avx512"
    assert cpu_kind(["avx2", "avx512f", "amx_tile", "amx_bf16"]) == "avx512_amx"
    assert cpu_kind(["sse4_2"]) == UNKNOWN


def test_demo_record_keeps_the_gate_failed_events_of_the_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger shaped like the demo's progressive-delivery block, written by the real
    ledger, read by the real script: the approval gate's refusal before the approvals, the
    perf gates' refusal of a `--no-canary` promotion (with its gate report's figures) and the
    watch's rollback after a promotion are in the file, with the users' summary; a refusal
    from before the block, of a release it never approves, is not."""
    from releasekit.config import load_settings
    from releasekit.promote.gates import GateReport, GateResult
    from releasekit.promote.report import write_report
    from releasekit.stores.ledger import open_ledger
    from releasekit.stores.ledger.schema import Event, EventType

    for key in list(os.environ):
        if key.startswith("RELEASEKIT_"):
            monkeypatch.delenv(key)
    (tmp_path / "releasekit.toml").write_text("")
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(tmp_path / "releasekit.toml"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    good, seqs1, other = "a" * 64, "b" * 64, "c" * 64

    def ev(kind: EventType, release: str, reason: str) -> Event:
        return Event(type=kind, environment="staging", to_release=release, reason=reason)

    report = GateReport(
        environment="staging",
        candidate_release_id=seqs1,
        candidate_name="demo-canary-seqs1",
        mode="relative",
        passed=False,
        gates=[
            GateResult(
                name="ttft_p95_s at the knee",
                kind="perf",
                passed=False,
                rule="at most 50% above live",
                candidate=0.9,
                live=0.4,
                limit=0.6,
            )
        ],
    )
    json_path, _ = write_report(report, tmp_path, stem="staging-demo-canary-seqs1")
    led = open_ledger(load_settings(root=tmp_path))
    refused = Event(
        type=EventType.GATE_FAILED,
        environment="staging",
        to_release=seqs1,
        reason="demo: one switch",
        evidence={"report": str(json_path)},
    )
    for event in [
        ev(EventType.GATE_FAILED, other, "an earlier release's gates"),
        ev(EventType.GATE_FAILED, good, "demo: before approval"),
        ev(EventType.APPROVE, good, "reviewed"),
        ev(EventType.APPROVE, seqs1, "its gates and canary decide"),
        ev(EventType.SHADOW, good, "mirror"),
        ev(EventType.CANARY_STEP, good, "step 1 passed"),
        ev(EventType.PROMOTE, good, "canary steps"),
        refused,
        ev(EventType.CANARY_ABORTED, seqs1, "breach"),
        ev(EventType.PROMOTE, other, "demo: v2 repackaged, shadow skipped"),
        ev(EventType.ROLLBACK, good, "watch: answers disagree after the promotion"),
    ]:
        led.append(event)
    (tmp_path / ".releasekit").mkdir(exist_ok=True)
    (tmp_path / ".releasekit" / "demo-users.out").write_text("traffic: release aaaa: 9 answered\n")
    out = tmp_path / "demo_progressive.json"
    script = REPO / "benchmarks" / "demo_record.py"
    res = subprocess.run(
        [sys.executable, str(script), "--project", str(tmp_path), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    got = [(e["type"], e["reason"]) for e in data["events"]]
    assert got[0] == ("gate_failed", "demo: before approval")
    assert ("gate_failed", "demo: one switch") in got
    (one,) = [e for e in data["events"] if e["reason"] == "demo: one switch"]
    assert one["gates"] == [
        {
            "name": "ttft_p95_s at the knee",
            "kind": "perf",
            "passed": False,
            "advisory": False,
            "candidate": 0.9,
            "live": 0.4,
            "limit": 0.6,
            "detail": "",
        }
    ]
    assert all(e["gates"] is None for e in data["events"] if e is not one)
    assert ("gate_failed", "an earlier release's gates") not in got
    assert [t for t, _ in got].count("approve") == 2
    assert got[-1] == ("rollback", "watch: answers disagree after the promotion")
    assert data["users"] == ["traffic: release aaaa: 9 answered"]
    for dotted in RUN_FIELDS:
        assert _field(data["run"], dotted) not in (None, "")

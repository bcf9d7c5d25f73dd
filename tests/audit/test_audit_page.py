"""`releasekit audit page`: one self-contained HTML page per environment, read in a real
headless browser: the timeline of what was live, and each decision with its actor, policy,
gates and figures, evidence digests and replay. An unknown environment is one line and
writes nothing; a swapped evidence file or gate report shows as a failed check, never as
data; the command only reads (nothing but the page is written)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "deploy"))  # the deploy tests' fixtures (promote_kit.py)

from promote_kit import ACTOR, Kit  # noqa: E402
from test_break_glass import _two_releases, signed_kit  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from releasekit.audit.page import write_page  # noqa: E402
from releasekit.cli import app  # noqa: E402
from releasekit.stores.ledger import Ledger  # noqa: E402
from releasekit.stores.results import ReleasePaths  # noqa: E402

__all__ = ["signed_kit"]

VOID = {"meta", "br", "img", "link", "input", "hr", "col", "source", "wbr"}


@dataclass
class Node:
    """An element of a parsed page: tag, attributes, children, and its text."""

    tag: str
    attrs: dict[str, str]
    children: list[Node] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts) + "".join(c.text for c in self.children)

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def find_all(self, tag: str | None = None, *, cls: str | None = None) -> list[Node]:
        out = []
        for c in self.children:
            if (tag is None or c.tag == tag) and (cls is None or cls in c.classes()):
                out.append(c)
            out += c.find_all(tag, cls=cls)
        return out

    def by_id(self, ident: str) -> Node:
        found = [n for n in self.find_all() if n.attrs.get("id") == ident]
        assert len(found) == 1, f"{len(found)} elements with id {ident!r}"
        return found[0]


class _Tree(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.root = Node("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].parts.append(data)


def parse(page: str) -> Node:
    """The page as a tree of Nodes (html.parser)."""
    t = _Tree()
    t.feed(page)
    return t.root


def browser_dom(path: Path) -> str:
    """The DOM of `path` after its scripts ran, as headless Chromium dumps it. Without
    chromium: skipped locally, a failure in CI (the CI variable set)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (scripts/system-deps.sh installs it)")
        pytest.skip("chromium is not installed (scripts/system-deps.sh installs it)")
    run = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", path.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "<html" in run.stdout, run.stderr[-2000:]
    return run.stdout


def _decision_seq(k: Kit, rid: str) -> int:
    recs = Ledger(k.settings.ledger_url or "").records(release=rid)
    return next(r.seq for r in recs if r.type == "promote" and r.to_release == rid)


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes, but the processes' logs and SQLite's own
    bookkeeping: a database counts by its rows (its dump), not its pages, and its
    write-ahead log and shared-memory index are left out (a reader's connection may
    checkpoint the log into the database on close: the same rows, other bytes)."""
    out: dict[str, bytes] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or "logs" in p.parts or p.name.endswith(("-shm", "-wal", "-journal")):
            continue
        data = p.read_bytes()
        if data.startswith(b"SQLite format 3\x00"):
            with contextlib.closing(sqlite3.connect(f"file:{p}?mode=ro", uri=True)) as db:
                data = "\n".join(db.iterdump()).encode()
        out[str(p.relative_to(root))] = data
    return out


def test_the_page_shows_the_timeline_and_a_decisions_gates_in_a_browser(
    signed_kit: Kit,
) -> None:
    """In the DOM a browser builds: one timeline row per release put live (the newest
    current), and the promotion's section with its actor, policy, verified gate report,
    passing gates with their figures, signed evidence and a replay that comes out the
    same. The command prints the page's path and writes nothing else."""
    k = signed_kit
    old, new = _two_releases(k)
    state = k.settings.state_dir
    before = _files(state)
    res = CliRunner().invoke(app, ["audit", "page", "--env", "staging"])
    assert res.exit_code == 0, res.output
    path = Path(res.output.strip())
    assert path == state / "reports" / "audit" / "staging.html" and path.is_file()
    after = _files(state)
    assert set(after) - set(before) == {"reports/audit/staging.html"}
    assert all(after[f] == b for f, b in before.items()), "the page command changed a file"

    dom = parse(browser_dom(path))
    assert dom.find_all("body")[0].attrs.get("data-drawn") == "yes"  # its script ran
    assert "0 replayed different" in dom.by_id("summary").text
    spans = dom.by_id("timeline").find_all("tr", cls="span")
    assert [s.find_all("code")[0].text for s in spans] == [old[:12], new[:12]]
    assert "current" in spans[-1].classes() and "current" not in spans[0].classes()

    seq = _decision_seq(k, new)
    d = dom.by_id(f"decision-{seq}")
    assert d.attrs["data-replay"] == "same"
    assert d.find_all("dd", cls="actor")[0].text == ACTOR
    assert "committed at commit" in d.find_all("dd", cls="policy")[0].text
    assert "verified" in d.find_all("dd", cls="gate-report")[0].text
    rows = d.find_all("table", cls="gates")[0].find_all("tr", cls="gate")
    results = {r.find_all("td")[0].text: r.find_all("td", cls="result")[0].text for r in rows}
    assert len(results) >= 5 and set(results.values()) == {"pass"}, results
    assert any(k_.startswith("eval evidence") for k_ in results)
    figures = [[c.text for c in r.find_all("td")[3:6]] for r in rows]
    assert any(f != ["-", "-", "-"] for f in figures), "no gate shows a figure"
    assert "verified" in d.find_all("p", cls="evidence-status")[0].classes()
    digests = d.find_all("table", cls="evidence")[0].find_all("tr", cls="pass")
    assert any("eval.json" in r.text for r in digests)
    # The page links the gate report relative to itself.
    link = next(a for a in d.find_all("a") if a.text == "JSON")
    assert (path.parent / link.attrs["href"]).resolve().is_file()


def test_an_unknown_environment_is_one_line_and_writes_nothing(signed_kit: Kit) -> None:
    """`--env nowhere`: one error line naming it (and the remedy), exit 1, no folder or
    file written; a known one with nothing live is a page with an empty timeline."""
    k = signed_kit
    k.build("demo-bf16")
    before = _files(k.settings.state_dir)
    res = CliRunner().invoke(app, ["audit", "page", "--env", "nowhere"])
    assert res.exit_code == 1 and "unknown environment 'nowhere'" in res.output
    lines = res.output.strip().splitlines()  # the error, and the CLI's remedy line
    assert lines[0].startswith("error: unknown environment") and "Traceback" not in res.output
    assert [x.lstrip().split(":")[0] for x in lines[1:]] == ["hint"]
    assert _files(k.settings.state_dir) == before
    assert not (k.settings.state_dir / "reports" / "audit").exists()
    # A known environment with nothing live yet: `--json` prints the page's data.
    res = CliRunner().invoke(app, ["audit", "page", "--env", "staging", "--json", "--out", "x"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert (data["environment"], data["timeline"], data["decisions"]) == ("staging", [], [])
    assert Path(data["path"]) == (k.root / "x" / "staging.html").resolve()


def test_a_swapped_evidence_file_or_gate_report_shows_as_failed(signed_kit: Kit) -> None:
    """A release's eval.json changed after it was registered, and a gate report replaced
    by another decision's: the page shows both as failed checks (the replay different),
    and the swapped report's figures are not shown as the decision's."""
    k = signed_kit
    old, new = _two_releases(k)
    seq = _decision_seq(k, new)
    eval_json = ReleasePaths.of(k.settings, new).eval_dir / "eval.json"
    eval_json.write_bytes(eval_json.read_bytes().replace(b"demo", b"dem0", 1))
    recs = Ledger(k.settings.ledger_url or "").records(environment="staging")
    reports = {r.seq: r.evidence["gate_report"] for r in recs if r.type == "promote"}
    first = _decision_seq(k, old)
    report = Path(reports[seq])
    report.write_bytes(Path(reports[first]).read_bytes())

    page = write_page(k.settings, "staging")
    d = next(x for x in page.decisions if x.seq == seq)
    assert d.evidence is not None and not d.evidence.ok
    assert d.replay == "different"
    assert d.gate_report is not None and d.gate_report.status == "failed"
    assert f"differs from the sha256 record {seq} signed" in d.gate_report.detail
    assert d.gates_from.startswith("the signed ledger record") and all(not g.rule for g in d.gates)
    assert json.loads(page.model_dump_json())["environment"] == "staging"

    dom = parse(Path(page.path or "").read_text())
    sec = dom.by_id(f"decision-{seq}")
    status = sec.find_all("p", cls="evidence-status")[0]
    assert "failed" in status.classes() and "FAILED" in status.text
    bad = sec.find_all("table", cls="evidence")[0].find_all("tr", cls="fail")
    assert any("eval.json" in r.text and "differs" in r.text for r in bad)
    assert "failed" in sec.find_all("dd", cls="gate-report")[0].text
    # The other decision is untouched.
    assert dom.by_id(f"decision-{first}").attrs["data-replay"] == "same"


def test_recorded_text_is_escaped_and_a_missing_name_is_an_error(tmp_path: Path) -> None:
    """Every text a record holds (an actor, a reason, a gate's detail) comes out as text,
    never as markup; a template that names what its context lacks fails instead of
    rendering an empty cell."""
    import datetime as dt

    import jinja2

    from releasekit._support.html import Templates
    from releasekit.audit.page import render_page
    from releasekit.audit.page_models import AuditPage, DecisionEntry, GateRow, LiveSpan

    now = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
    evil = "<script>alert(1)</script>"
    page = AuditPage(
        environment="prod",
        generated_at=now,
        ledger_ok=True,
        timeline=[
            LiveSpan(seq=3, event_id="e", type="promote", release_id="a" * 64, actor=evil,
                     reason=evil, since=now)
        ],
        decisions=[
            DecisionEntry(seq=3, event_id="e", type="promote", time=now, actor=evil, reason="r",
                          live=True, gates=[GateRow(name="g", result="pass", detail=evil)])
        ],
    )  # fmt: skip
    out = render_page(page)
    assert evil not in out and out.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 4
    (tmp_path / "t.html").write_text("{{ missing }}")
    with pytest.raises(jinja2.UndefinedError):
        Templates(tmp_path).render("t.html")


def test_a_gate_report_edited_where_no_figure_changes_fails_by_its_signed_digest(
    signed_kit: Kit,
) -> None:
    """A gate report whose rule text is edited (every verdict and figure as signed) still
    fails: the promote event signs the report's sha256."""
    k = signed_kit
    _old, new = _two_releases(k)
    seq = _decision_seq(k, new)
    rec = next(r for r in Ledger(k.settings.ledger_url or "").records() if r.seq == seq)
    report = Path(rec.evidence["gate_report"])
    assert rec.evidence["gate_report_sha256"] == hashlib.sha256(report.read_bytes()).hexdigest()
    data = json.loads(report.read_bytes())
    data["gates"][0]["rule"] = "anything goes"
    report.write_text(json.dumps(data))

    page = write_page(k.settings, "staging")
    d = next(x for x in page.decisions if x.seq == seq)
    assert d.gate_report is not None and d.gate_report.status == "failed"
    assert "differs from the sha256" in d.gate_report.detail


def _record(type_: str, evidence: dict[str, object]) -> object:
    import datetime as dt

    from releasekit.stores.ledger import LedgerRecord

    return LedgerRecord(
        seq=7,
        event_id="e" * 32,
        type=type_,
        time=dt.datetime(2026, 12, 7, tzinfo=dt.UTC),
        actor="someone",
        environment="staging",
        from_release="a" * 64,
        to_release="b" * 64,
        reason="canary",
        evidence=evidence,
        live=False,
        prev_hash="0" * 64,
        hash="1" * 64,
    )


def test_a_canarys_disjoint_window_and_start_up_transient_show_as_rows() -> None:
    """An abort shows each breach's disjoint window with its figures (or why it stood
    without one); a step whose first breach did not hold shows it as a start-up transient."""
    from releasekit.audit.page import _judged_rows

    confirmed = {"verdict": "breach", "canary": 0.9, "stable": 0.1, "limit": 0.2, "reason": "x"}
    aborted = _record(
        "canary_aborted",
        {"breaches": [{"metric": "ttft_p95_s", "confirmed_by": confirmed}, {"metric": "tpot"}]},
    )
    rows = {r.name: r for r in _judged_rows(aborted)}  # type: ignore[arg-type]
    held = rows["ttft_p95_s: disjoint window"]
    assert (held.result, held.passed, held.candidate, held.live) == ("breach", False, 0.9, 0.1)
    assert "decided by sustain alone" in rows["tpot: disjoint window"].detail
    step = _record(
        "canary_step",
        {"checks": [], "unconfirmed_breach": {"window": [10.0, 34.0], "breached": ["ttft_p95_s"]}},
    )
    [row] = _judged_rows(step)  # type: ignore[arg-type]
    assert row.result == "start-up transient" and row.passed
    assert "ttft_p95_s breached over 24 s" in row.detail

"""Promotion gates over synthetic evidence files (promote_kit's made-up eval outcomes and
load-sweep points, written by the real writers): quality per suite against the live release,
perf at the knee, and missing or mismatched evidence as failures, never passes. The gates on
evidence from real builds are in test_gates_real_vllm.py."""

from __future__ import annotations

import json

from promote_kit import GOODPUT_LINE, Kit, kit

from releasekit.promote.context import load_release
from releasekit.promote.gates import GateReport, evaluate_gates
from releasekit.promote.report import gate_rows, render_html, report_json
from releasekit.releases.register import register_release
from releasekit.stores.ledger import Ledger
from releasekit.stores.results import ReleasePaths

__all__ = ["kit"]


def _gates(k: Kit, cand: str, live: str | None) -> GateReport:
    led = Ledger(k.settings.ledger_url or "")
    ci = load_release(k.settings, k.rids[cand], ledger=led)
    li = load_release(k.settings, k.rids[live], ledger=led) if live else None
    return evaluate_gates(k.settings, env="staging", candidate=ci, live=li)


def _gate(rep: GateReport, name: str):  # type: ignore[no-untyped-def]
    return next(g for g in rep.gates if g.name == name)


def test_equal_evidence_passes_every_gate_with_numbers_and_rules(kit: Kit) -> None:
    """A candidate as good as the live release passes: each suite non-inferior (interval
    shown), SLOs, TTFT p95 and goodput at the live knee within the tolerances."""
    kit.build("demo-bf16")
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", baseline="demo-bf16")
    rep = _gates(kit, "demo-v2", "demo-bf16")
    assert rep.passed, [g for g in rep.gates if not g.passed]
    assert rep.mode == "relative" and rep.comparison_source == "report"
    core = _gate(rep, "suite core")
    assert core.candidate == 1.0 and core.live == 1.0 and core.limit == -0.05
    assert "non_inferior" in core.detail and "CI" in core.detail
    ttft = _gate(rep, "ttft_p95_s at the knee")
    assert ttft.live == 0.2 and ttft.limit is not None and abs(ttft.limit - 0.3) < 1e-9
    assert "manifest tolerance" in ttft.rule  # the manifest's margin 0.5 ... of the live value
    assert _gate(rep, "goodput at the knee").passed


def test_damaged_prompt_is_blocked_by_the_quality_gate_naming_suite_and_drop(kit: Kit) -> None:
    """A release failing 60 of 528 core items more than the live one is inferior on core;
    the gate says so with the pass rates."""
    kit.build("demo-bf16")
    kit.build("demo-damaged-prompt", fail={"core": 60})
    rep = _gates(kit, "demo-damaged-prompt", "demo-bf16")
    assert not rep.passed
    core = _gate(rep, "suite core")
    assert not core.passed and core.detail.startswith("inferior")
    assert core.candidate == (528 - 60) / 528 and core.live == 1.0
    assert [g.name for g in rep.failed] == ["suite core"]
    assert rep.comparison_source == "computed"  # its compare.json is absent


def test_comparison_against_another_baseline_is_recomputed_against_live(kit: Kit) -> None:
    """compare.json made against a release that is not live is not used: the gate compares
    with the live release's eval instead."""
    kit.build("demo-bf16")
    kit.variant("demo-bf16", "demo-old", {"max-num-seqs: 32": "max-num-seqs: 8"})
    kit.build("demo-old", fail={"core": 100})
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", fail={"core": 40}, baseline="demo-old")
    stored = json.loads(ReleasePaths.of(kit.settings, kit.rids["demo-v2"]).compare.read_text())
    assert stored["verdict"] in ("superior", "non_inferior")  # better than the old one
    rep = _gates(kit, "demo-v2", "demo-bf16")
    assert rep.comparison_source == "computed"
    assert not _gate(rep, "suite core").passed  # but worse than what is live


def test_a_different_load_profile_is_mismatched_evidence(kit: Kit) -> None:
    """Bench results made with another load profile fail the evidence gate, and no perf
    comparison is made from them."""
    kit.build("demo-bf16")
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", profile_digest="0" * 64)
    rep = _gates(kit, "demo-v2", "demo-bf16")
    assert not _gate(rep, "bench evidence (candidate)").passed
    same = _gate(rep, "same load profile as live")
    assert not same.passed and "mismatched evidence" in same.detail
    assert not any(g.name == "ttft_p95_s at the knee" for g in rep.gates)


def test_a_different_suite_file_is_missing_evidence(kit: Kit) -> None:
    """When the candidate was evaluated on an edited suite file, the suite gate fails as
    missing evidence and the evidence gate names the suite."""
    kit.build("demo-bf16")
    suite = kit.root / "pipelines" / "eval" / "edge.jsonl"
    suite.write_text(suite.read_text().splitlines()[0] + "\n")
    kit.build("demo-damaged-prompt")
    rep = _gates(kit, "demo-damaged-prompt", "demo-bf16")
    assert not rep.passed
    assert "edge" in _gate(rep, "same eval suites as live").detail
    assert _gate(rep, "suite edge").detail.startswith("missing_evidence")


def test_slower_knee_fails_the_ttft_gate_and_lower_goodput_the_goodput_gate(kit: Kit) -> None:
    """TTFT p95 at the live knee above live x 1.5 (the manifest's margin) fails; goodput
    below live x 0.9 (the default tolerance) fails."""
    kit.build("demo-bf16")
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16", GOODPUT_LINE: ""})
    kit.build("demo-v2", knee_ttft=0.31, knee_goodput=7.0)
    rep = _gates(kit, "demo-v2", "demo-bf16")
    assert {g.name for g in rep.failed} == {"ttft_p95_s at the knee", "goodput at the knee"}
    goodput = _gate(rep, "goodput at the knee")
    assert goodput.candidate == 7.0 and goodput.limit is not None and goodput.limit > 7.0
    assert "default tolerance" in goodput.rule


def test_a_difference_within_the_run_to_run_spread_is_noise_not_a_regression(kit: Kit) -> None:
    """Goodput 12.5% below live fails a 10% tolerance, unless the live release's own runs at
    that load spread wider than that (here 25%): then the host's noise is the tolerance, and
    the rule says so."""
    kit.build("demo-bf16")
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16", GOODPUT_LINE: ""})
    kit.build("demo-v2", knee_goodput=7.0)
    assert not _gate(_gates(kit, "demo-v2", "demo-bf16"), "goodput at the knee").passed
    # A live release whose load test (as registered) spread 25% at that load.
    kit.variant("demo-bf16", "demo-noisy", {"max-num-seqs: 32": "max-num-seqs: 8"})
    kit.build("demo-noisy", register=False)
    bench = ReleasePaths.of(kit.settings, kit.rids["demo-noisy"]).bench
    data = json.loads(bench.read_text())
    noisy = {"n": 3, "min": 6.5, "median": 8.0, "max": 8.5}
    for point in [*data["points"], data["knee"]]:
        if point["load"] == 16:
            point["spread"]["goodput"] = noisy
    bench.write_text(json.dumps(data))
    register_release(kit.settings, kit.manifest("demo-noisy"))
    goodput = _gate(_gates(kit, "demo-v2", "demo-noisy"), "goodput at the knee")
    assert goodput.passed and "run-to-run spread 0.25" in goodput.rule
    assert goodput.limit == 8.0 * 0.75


def test_flagged_or_unstable_knee_fails_the_slo_gate(kit: Kit) -> None:
    """A knee carrying a reliability flag, or one that differs between repetitions, is not
    evidence that the SLOs hold."""
    kit.build("demo-bf16")
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", flagged_knee=True)
    kit.variant("demo-bf16", "demo-v3", {"max-num-seqs: 32": "max-num-seqs: 8"})
    kit.build("demo-v3", stable=False)
    flagged = _gate(_gates(kit, "demo-v2", "demo-bf16"), "SLOs hold at the knee (candidate)")
    assert not flagged.passed and "client_bound" in flagged.detail
    unstable = _gate(_gates(kit, "demo-v3", "demo-bf16"), "SLOs hold at the knee (candidate)")
    assert not unstable.passed and "not stable" in unstable.detail


def test_missing_eval_results_fail_closed(kit: Kit) -> None:
    """A candidate without eval results fails its evidence gate and every quality gate."""
    kit.build("demo-bf16")
    kit.build("demo-damaged-prompt")
    eval_json = ReleasePaths.of(kit.settings, kit.rids["demo-damaged-prompt"]).eval
    eval_json.unlink()
    rep = _gates(kit, "demo-damaged-prompt", "demo-bf16")
    assert not _gate(rep, "eval evidence (candidate)").passed
    assert not _gate(rep, "quality comparison").passed
    assert not rep.passed


def test_absolute_mode_uses_the_suites_minimum_pass_rates(kit: Kit) -> None:
    """With nothing live, a suite with min_pass_rate must reach it on the candidate's own
    eval; the SLOs at its own knee must hold."""
    kit.variant(
        "demo-bf16",
        "demo-min",
        {
            "scorer: exact_match, margin: 0.05}": (
                "scorer: exact_match, margin: 0.05, min_pass_rate: 0.9}"
            )
        },
    )
    kit.build("demo-min", fail={"core": 106})  # 422 of 528 pass: 0.799
    rep = _gates(kit, "demo-min", None)
    assert rep.mode == "absolute"
    core = _gate(rep, "suite core")
    assert not core.passed and core.candidate == (528 - 106) / 528 and core.limit == 0.9
    assert _gate(rep, "SLOs hold at the knee (candidate)").passed


def test_report_renders_table_json_and_html_with_both_curves(kit: Kit) -> None:
    """The gate report comes as rows, JSON that reads back, and an HTML page with the
    plot of both releases and a link to the eval comparison."""
    kit.build("demo-bf16")
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", baseline="demo-bf16")
    rep = _gates(kit, "demo-v2", "demo-bf16")
    rows = gate_rows(rep)
    assert rows[0][0] == "eval evidence (candidate)" and rows[0][2] == "pass"
    assert GateReport.model_validate_json(report_json(rep)) == rep
    page = render_html(rep, comparison_href="../report/report.html")
    assert "data:image/png;base64," in page and 'href="../report/report.html"' in page
    assert len(rep.candidate_curve) == 4 and len(rep.live_curve) == 4


EDGE_LINE = (
    "    - {name: edge, kind: edge, path: pipelines/eval/edge.jsonl, scorer: refusal, "
    "margin: 0.10}\n"
)


def _with_new_suite(k: Kit, name: str, floor: str) -> None:
    """A variant of demo-bf16 with one suite the live release lacks (`extra`, on the edge
    items), held to `floor` (a manifest field, or nothing)."""
    k.variant(
        "demo-bf16",
        name,
        {
            "max-num-seqs: 32": "max-num-seqs: 16",
            EDGE_LINE: EDGE_LINE
            + "    - {name: extra, kind: edge, path: pipelines/eval/edge.jsonl, "
            f"scorer: refusal{floor}}}\n",
        },
    )


def test_a_suite_the_live_release_lacks_is_held_to_its_floor(kit: Kit) -> None:
    """A new suite (an adapter's own, say) cannot be compared with the live release: it is
    held to its min_pass_rate, and the suites both carry are compared as ever."""
    kit.build("demo-bf16")
    _with_new_suite(kit, "demo-new", ", min_pass_rate: 0.5")
    kit.build("demo-new")
    rep = _gates(kit, "demo-new", "demo-bf16")
    assert rep.passed, [g for g in rep.gates if not g.passed]
    same = _gate(rep, "same eval suites as live")
    assert same.passed and "new: extra" in same.detail
    extra = _gate(rep, "suite extra")
    assert extra.limit == 0.5 and "the live release lacks this suite" in extra.rule
    assert _gate(rep, "suite core").live == 1.0  # still compared with live

    _with_new_suite(kit, "demo-weak", ", min_pass_rate: 0.9")
    kit.build("demo-weak", fail={"extra": 20})
    rep = _gates(kit, "demo-weak", "demo-bf16")
    assert [g.name for g in rep.failed] == ["suite extra"]


def test_a_new_suite_without_a_floor_fails_saying_what_to_set(kit: Kit) -> None:
    kit.build("demo-bf16")
    _with_new_suite(kit, "demo-new", "")
    kit.build("demo-new")
    rep = _gates(kit, "demo-new", "demo-bf16")
    extra = _gate(rep, "suite extra")
    assert not extra.passed and "min_pass_rate" in extra.detail
    assert [g.name for g in rep.failed] == ["suite extra"]


def test_a_suite_the_candidate_drops_is_still_missing_evidence(kit: Kit) -> None:
    kit.build("demo-bf16")
    kit.variant("demo-bf16", "demo-less", {"max-num-seqs: 32": "max-num-seqs: 16", EDGE_LINE: ""})
    kit.build("demo-less")
    rep = _gates(kit, "demo-less", "demo-bf16")
    same = _gate(rep, "same eval suites as live")
    assert not same.passed and "edge" in same.detail

"""An environment's policy belongs to the environment: it is read from a committed
releasekit.toml, a one-command change is refused, the candidate's manifest may only make a
gate stricter, every promote, gate_failed and rollback event records the policy and its
source, and `history` / `show` print advisory and overridden gates beside the event.

Each attack is run against the real component (settings, promote, the CLI) and refused."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from promote_kit import (
    GOODPUT_LINE,
    Kit,
    commit_config,
    kill_everything,
    kit,
    make_kit,
)
from typer.testing import CliRunner

from releasekit._support.digests import digest_obj
from releasekit.cli import app
from releasekit.cli._common import State
from releasekit.config import EnvironmentConfig, load_settings
from releasekit.promote.context import load_release
from releasekit.promote.gates import GateReport, evaluate_gates
from releasekit.promote.policy import PolicyError, read_policy
from releasekit.promote.promote import PERF_BY_CANARY_UNUSED, promote
from releasekit.promote.rollback import rollback
from releasekit.releases.register import register_release
from releasekit.rollout.progressive import promote_progressive
from releasekit.stores.ledger import Ledger
from releasekit.stores.results import ReleasePaths

__all__ = ["kit"]


def _head(k: Kit) -> str:
    return subprocess.run(
        ["git", "-C", str(k.root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()


def _branch(k: Kit) -> str:
    return subprocess.run(
        ["git", "-C", str(k.root), "symbolic-ref", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _set_policy(k: Kit, env: str, line: str, *, commit: bool) -> None:
    """Add `line` to `[environments.ENV]` of the kit's releasekit.toml (and commit it)."""
    toml = k.root / "releasekit.toml"
    head = f"[environments.{env}]\n"
    toml.write_text(toml.read_text().replace(head, head + line + "\n"))
    if commit:
        commit_config(k.root, f"{env}: {line}")
    k.settings = load_settings(root=k.root)


def _gates(k: Kit, cand: str, live: str | None, policy: EnvironmentConfig) -> GateReport:
    for name in (cand, live):  # sign the evidence as the test made it (no-op once signed)
        if name is not None:
            register_release(k.settings, k.manifest(name))
    led = Ledger(k.settings.ledger_url or "")
    ci = load_release(k.settings, k.rids[cand], ledger=led)
    li = load_release(k.settings, k.rids[live], ledger=led) if live else None
    return evaluate_gates(k.settings, env="staging", candidate=ci, live=li, policy=policy)


def _gate(rep: GateReport, name: str):  # type: ignore[no-untyped-def]
    return next(g for g in rep.gates if g.name == name)


# -- one-command changes ----------------------------------------------------------------


def test_a_policy_set_for_one_command_by_a_variable_is_refused_naming_the_fields(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RELEASEKIT_ENVIRONMENTS turning staging's gates advisory and letting its canary judge
    perf, for one command: promote refuses with one line naming both fields (the CLI exits
    1); without the variable the same promotion is judged."""
    kit.build("demo-bf16")
    monkeypatch.setenv(
        "RELEASEKIT_ENVIRONMENTS", '{"staging": {"gates_required": false, "perf_by_canary": true}}'
    )
    lax = load_settings(root=kit.root)
    assert lax.environments["staging"].gates_required is False  # the variable took effect
    with pytest.raises(PolicyError) as info:
        promote(lax, kit.rids["demo-bf16"], env="staging", dry_run=True)
    msg = info.value.message
    assert "differs from releasekit.toml at HEAD" in msg
    assert "gates_required, perf_by_canary" in msg and "\n" not in msg

    State.reset()
    r = CliRunner().invoke(
        app, ["promote", "manifests/demo-bf16.yaml", "--to", "staging", "--dry-run"]
    )
    assert r.exit_code == 1
    assert "gates_required, perf_by_canary" in r.output and "Traceback" not in r.output

    monkeypatch.delenv("RELEASEKIT_ENVIRONMENTS")
    ok = promote(load_settings(root=kit.root), kit.rids["demo-bf16"], env="staging", dry_run=True)
    assert ok.status == "dry_run" and ok.report is not None and ok.report.passed


def test_an_uncommitted_edit_or_environment_is_refused_until_committed(kit: Kit) -> None:
    """An edit to releasekit.toml that lowers a floor is refused until it is committed; an
    environment that exists only in the working tree is refused as not committed."""
    kit.build("demo-bf16")
    _set_policy(kit, "staging", "min_pass_rate = { core = 0.1 }", commit=False)
    with pytest.raises(PolicyError, match=r"differs from .* in min_pass_rate"):
        promote(kit.settings, kit.rids["demo-bf16"], env="staging", dry_run=True)
    commit_config(kit.root, "staging: a lower core floor")
    res = promote(kit.settings, kit.rids["demo-bf16"], env="staging", dry_run=True)
    assert res.report is not None and res.report.passed

    toml = kit.root / "releasekit.toml"
    toml.write_text(toml.read_text() + "\n[environments.qa]\nport = 25001\n")
    kit.settings = load_settings(root=kit.root)
    with pytest.raises(PolicyError, match=r"'qa' is not in releasekit\.toml at HEAD"):
        promote(kit.settings, kit.rids["demo-bf16"], env="qa", dry_run=True)


def test_a_config_file_elsewhere_cannot_stand_in_for_the_committed_one(
    kit: Kit, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """RELEASEKIT_CONFIG pointing at another file with staging's approval switched off is
    compared with the project's committed releasekit.toml, and refused."""
    kit.build("demo-bf16")
    _set_policy(kit, "staging", "requires_approval = true", commit=True)
    other = tmp_path / "other.toml"
    other.write_text((kit.root / "releasekit.toml").read_text().replace(
        "requires_approval = true", "requires_approval = false"
    ))  # fmt: skip
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(other))
    with pytest.raises(PolicyError, match="in requires_approval"):
        promote(load_settings(root=kit.root), kit.rids["demo-bf16"], env="staging", dry_run=True)


def test_outside_a_git_repository_the_policy_on_disk_is_recorded_as_uncommitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no git repository there is no committed revision: the file on disk is the
    policy (as the trusted keys are then the keys/ folder), recorded as uncommitted."""
    for key in [k for k in os.environ if k.startswith("RELEASEKIT_")]:
        monkeypatch.delenv(key)
    (tmp_path / "releasekit.toml").write_text("[environments.staging]\nport = 25002\n")
    monkeypatch.setenv("RELEASEKIT_CONFIG", str(tmp_path / "releasekit.toml"))
    settings = load_settings(root=tmp_path)
    cfg = settings.environments["staging"]
    pol = read_policy(settings, "staging", cfg)
    assert pol.source.kind == "uncommitted" and pol.source.note == "not a git repository"
    assert pol.source.digest == digest_obj(cfg.policy()) and pol.differs == []
    assert pol.evidence()["source"]["kind"] == "uncommitted"


# -- what is recorded -------------------------------------------------------------------


def test_promote_gate_failed_and_rollback_events_record_the_policy_and_its_source(
    kit: Kit,
) -> None:
    """Each event carries the policy it was decided by, the committed revision and the
    policy's digest; `history` prints overridden gates beside the override event, and `show`
    the same for the release."""
    led = Ledger(kit.settings.ledger_url or "")
    base = kit.build("demo-bf16")
    assert promote(kit.settings, base, env="staging", reason="base").status == "promoted"
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    slow = kit.build("demo-v2", knee_ttft=0.9, knee_goodput=3.0)
    blocked = promote(kit.settings, slow, env="staging", reason="try")
    assert blocked.status == "blocked"
    forced = promote(kit.settings, slow, env="staging", reason="known slower", force=["perf"])
    assert forced.status == "promoted"
    back = rollback(kit.settings, "staging", reason="back")
    assert back.status == "rolled_back", back.message

    committed = kit.settings.environments["staging"].policy()
    head = _head(kit)
    assert blocked.report is not None and blocked.report_html is not None
    assert blocked.report.policy_source == (
        f"releasekit.toml at HEAD ({head[:12]}), digest {digest_obj(committed)[:12]}"
    )
    assert (
        "Environment policy:</b> releasekit.toml at HEAD" in Path(blocked.report_html).read_text()
    )
    events = led.records(environment="staging")
    by_type = {e.type: e for e in events}
    for kind in ("promote", "gate_failed", "override", "rollback"):
        pol = by_type[kind].evidence["policy"]
        assert pol["policy"] == committed, kind
        assert pol["source"] == {
            "kind": "committed",
            "rev": "HEAD",
            "commit": head,
            "protected_ref": f"origin/{_branch(kit)}",
            "digest": digest_obj(committed),
        }, kind

    State.reset()
    r = CliRunner().invoke(app, ["history", "--env", "staging"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "overridden: ttft_p95_s at the knee, goodput at the knee" in text, r.output
    r = CliRunner().invoke(app, ["show", slow])
    assert r.exit_code == 0, r.output
    assert "overridden: ttft_p95_s at the knee" in " ".join(r.output.split())


# -- the manifest may only make a gate stricter -----------------------------------------


def test_a_manifest_margin_above_the_environment_ceiling_is_clamped(kit: Kit) -> None:
    """A release that sets core's margin to 0.5 is judged at the environment's ceiling
    (default 0.10): 60 of 528 core items lost is inferior there, and the gate says the
    manifest's margin was clamped; its own compare.json (at 0.5) is not used."""
    kit.build("demo-bf16", register=False)
    kit.variant(
        "demo-bf16",
        "demo-loose",
        {"scorer: exact_match, margin: 0.05}": "scorer: exact_match, margin: 0.5}"},
    )
    kit.build("demo-loose", fail={"core": 60}, baseline="demo-bf16", register=False)
    stored = json.loads(ReleasePaths.of(kit.settings, kit.rids["demo-loose"]).compare.read_text())
    assert stored["suites"]["core"]["verdict"] == "non_inferior"  # by its own margin
    rep = _gates(kit, "demo-loose", "demo-bf16", kit.settings.environments["staging"])
    core = _gate(rep, "suite core")
    assert not core.passed and core.limit == -0.10
    assert "clamped to the environment's ceiling" in core.detail
    assert rep.comparison_source == "computed"
    # A stricter margin than the ceiling is kept.
    strict = kit.settings.environments["staging"].model_copy(update={"max_margin": {"*": 0.6}})
    assert _gate(_gates(kit, "demo-loose", "demo-bf16", strict), "suite core").passed


def test_a_manifest_perf_tolerance_above_the_ceiling_is_clamped(kit: Kit) -> None:
    """A manifest TTFT tolerance of 3.0 (a candidate may be 4x slower) is clamped to the
    environment's ceiling (0.5 by default): a knee TTFT 2.5x live's fails, and the rule
    says so."""
    kit.build("demo-bf16", register=False)
    kit.variant(
        "demo-bf16",
        "demo-lax",
        {"kind: max_increase, margin: 0.5}": "kind: max_increase, margin: 3.0}"},
    )
    kit.build("demo-lax", knee_ttft=0.5, register=False)
    rep = _gates(kit, "demo-lax", "demo-bf16", kit.settings.environments["staging"])
    ttft = _gate(rep, "ttft_p95_s at the knee")
    assert not ttft.passed and ttft.limit == pytest.approx(0.2 * 1.5)
    assert "manifest tolerance 3 clamped to the environment's ceiling 0.5" in ttft.rule


def test_first_promotion_floors_come_from_the_environment_and_the_manifest_only_raises(
    kit: Kit,
) -> None:
    """With nothing live, staging's committed `min_pass_rate` decides: 0.80 on core fails a
    0.9 floor, though the manifest sets 0.5; a manifest floor above the environment's
    raises it; a suite without a floor is only checked for evidence."""
    _set_policy(kit, "staging", "min_pass_rate = { core = 0.9 }", commit=True)
    kit.variant(
        "demo-bf16",
        "demo-low",
        {
            "scorer: exact_match, margin: 0.05}": "scorer: exact_match, margin: 0.05, "
            "min_pass_rate: 0.5}"
        },
    )
    kit.build("demo-low", fail={"core": 106})  # 422 of 528: 0.799
    res = promote(kit.settings, kit.rids["demo-low"], env="staging", dry_run=True)
    assert res.report is not None and not res.report.passed
    core = _gate(res.report, "suite core")
    assert not core.passed and core.limit == 0.9
    assert "the environment's min_pass_rate" in core.rule
    assert _gate(res.report, "suite edge").passed and _gate(res.report, "suite edge").limit is None

    kit.variant(
        "demo-bf16",
        "demo-high",
        {
            "scorer: exact_match, margin: 0.05}": "scorer: exact_match, margin: 0.05, "
            "min_pass_rate: 0.99}"
        },
    )
    kit.build("demo-high", fail={"core": 30})  # 0.943: above staging's floor, below its own
    high = promote(kit.settings, kit.rids["demo-high"], env="staging", dry_run=True)
    assert high.report is not None
    core = _gate(high.report, "suite core")
    assert not core.passed and core.limit == 0.99 and "stricter" in core.rule


# -- perf gates that can fail -----------------------------------------------------------


def _spread(k: Kit, name: str, metric: str, spread: dict[str, float]) -> None:
    bench = ReleasePaths.of(k.settings, k.rids[name]).bench
    data = json.loads(bench.read_text())
    for point in [*data["points"], data["knee"]]:
        if point["load"] == 16:
            point["spread"][metric] = spread
    bench.write_text(json.dumps(data))


@pytest.mark.parametrize("side", ["live", "candidate"])
def test_a_run_to_run_spread_of_1_fails_as_evidence_on_either_side(kit: Kit, side: str) -> None:
    """A spread of 1 ((max - min) / median) at the live knee used to put the goodput limit
    at 0 and the TTFT limit at twice live: every candidate passed. Now it is above the cap
    (0.25): the comparison fails as an evidence gate, too noisy to judge, on either side."""
    kit.build("demo-bf16", register=False)
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", knee_ttft=0.35, knee_goodput=2.0, register=False)
    name = "demo-bf16" if side == "live" else "demo-v2"
    _spread(kit, name, "goodput", {"n": 3, "min": 4.0, "median": 8.0, "max": 12.0})
    _spread(kit, name, "ttft_p95_s", {"n": 3, "min": 0.1, "median": 0.2, "max": 0.3})
    rep = _gates(kit, "demo-v2", "demo-bf16", kit.settings.environments["staging"])
    for metric in ("goodput", "ttft_p95_s"):
        g = _gate(rep, f"{metric} at the knee")
        assert not g.passed and g.kind == "evidence", g
        assert "too noisy to judge here (" in g.detail and f"{side} spread 1.00" in g.detail
        assert g.against_live  # a comparison with live at its knee
    assert not rep.passed
    # Where canary steps judge performance live (perf_by_canary), they judge this too.
    live = rep.perf_judged_live()
    assert all(g.advisory for g in live.gates if "too noisy" in g.detail)
    assert not any(g.blocks for g in live.gates if g.kind in ("perf", "evidence")), live.failed


def test_the_candidates_own_spread_never_widens_its_tolerance(kit: Kit) -> None:
    """Goodput 12.5% below live fails a 10% tolerance; the candidate's own runs spreading
    0.25 (within the cap) do not widen it: only the live release's spread does."""
    kit.build("demo-bf16", register=False)
    kit.variant(
        "demo-bf16",
        "demo-v2",
        {"max-num-seqs: 32": "max-num-seqs: 16", GOODPUT_LINE: ""},  # the default tolerance
    )
    kit.build("demo-v2", knee_goodput=7.0, register=False)
    _spread(kit, "demo-v2", "goodput", {"n": 3, "min": 6.0, "median": 7.0, "max": 7.75})
    policy = kit.settings.environments["staging"]
    goodput = _gate(_gates(kit, "demo-v2", "demo-bf16", policy), "goodput at the knee")
    assert not goodput.passed and goodput.kind == "perf"
    assert goodput.limit == pytest.approx(8.0 * 0.9) and "widened" not in goodput.rule
    # The cap is the environment's: a tighter one fails the same live spread as evidence.
    kit.variant("demo-bf16", "demo-noisy", {"max-num-seqs: 32": "max-num-seqs: 8"})
    kit.build("demo-noisy", register=False)
    _spread(kit, "demo-noisy", "goodput", {"n": 3, "min": 6.5, "median": 8.0, "max": 8.5})
    tight = policy.model_copy(update={"max_perf_spread": 0.2})
    g = _gate(_gates(kit, "demo-v2", "demo-noisy", tight), "goodput at the knee")
    assert g.kind == "evidence" and not g.passed and "live spread 0.25 > 0.2" in g.detail


# -- perf_by_canary: only a canary that judges latency, only comparisons with live -------


@pytest.fixture
def pkit(
    project: Path,
    monkeypatch: pytest.MonkeyPatch,
    mlflow_template_db: Path,
    stand_in_model: Any,
) -> Iterator[Kit]:
    """The deploy kit with staging's committed `perf_by_canary = true`."""
    stand_in_model(project)
    k = make_kit(project, monkeypatch, mlflow_template_db, toml_lines=["perf_by_canary = true"])
    try:
        yield k
    finally:
        kill_everything(k.settings)


STEPS_25 = "      - {weight: 25, min_duration_s: 5}\n      - {weight: 100}\n"
TTFT = "      - {metric: ttft_p95_s, min_samples: 10}\n"


def _canary_candidate(k: Kit, name: str, steps: str, checks: str, **build: Any) -> str:
    path = k.variant("demo-bf16", name)
    path.write_text(
        path.read_text() + f"promotion:\n  canary:\n    steps:\n{steps}    checks:\n{checks}"
    )
    return k.build(name, **build)


def test_perf_by_canary_needs_a_judged_step_below_100_with_a_required_latency_check(
    pkit: Kit,
) -> None:
    """A canary of `[{weight: 100}]` (never judged), `checks: []`, only `error_rate`, or a
    latency check that is not required cannot stand in for the offline perf gates: they
    still block, and promote says why perf_by_canary did not apply."""
    old = pkit.build("demo-bf16")
    assert promote(pkit.settings, old, env="staging", reason="base").status == "promoted"
    cases = {
        "demo-c100": ("      - {weight: 100}\n", TTFT),
        "demo-cnone": (STEPS_25, "      []\n"),
        "demo-cerr": (STEPS_25, "      - {metric: error_rate}\n"),
        "demo-copt": (STEPS_25, "      - {metric: ttft_p95_s, required: false}\n"),
    }
    for name, (steps, checks) in cases.items():
        rid = _canary_candidate(pkit, name, steps, checks, knee_ttft=0.9, knee_goodput=3.0)
        res = promote_progressive(pkit.settings, rid, env="staging", dry_run=True)
        assert res.report is not None and not res.report.passed, name
        assert {g.kind for g in res.report.failed} == {"perf"}, name
        assert res.report.advisory_failed == [], name
        assert PERF_BY_CANARY_UNUSED in res.warnings, name


def test_perf_by_canary_never_excuses_the_candidates_own_knee_or_a_manifest_threshold(
    pkit: Kit,
) -> None:
    """With a canary that does judge latency at 25%, the comparisons with live are advisory,
    but the SLOs at the candidate's own knee and a manifest threshold still block."""
    old = pkit.build("demo-bf16")
    assert promote(pkit.settings, old, env="staging", reason="base").status == "promoted"
    good = _canary_candidate(pkit, "demo-cgood", STEPS_25, TTFT, knee_ttft=0.9, knee_goodput=3.0)
    res = promote_progressive(pkit.settings, good, env="staging", dry_run=True)
    assert res.report is not None and res.report.passed
    assert {g.name for g in res.report.advisory_failed} == {
        "ttft_p95_s at the knee",
        "goodput at the knee",
    }
    assert PERF_BY_CANARY_UNUSED not in res.warnings

    flagged = _canary_candidate(
        pkit, "demo-cflag", STEPS_25, TTFT, knee_ttft=0.9, knee_goodput=3.0, flagged_knee=True
    )
    res = promote_progressive(pkit.settings, flagged, env="staging", dry_run=True)
    assert res.report is not None and not res.report.passed
    assert "SLOs hold at the knee (candidate)" in [g.name for g in res.report.failed]

    path = pkit.variant("demo-bf16", "demo-cmax")
    path.write_text(
        path.read_text().replace(
            "gates:\n", "gates:\n  - {metric: bench.knee.ttft_p95_s, kind: max, threshold: 0.5}\n"
        )
        + f"promotion:\n  canary:\n    steps:\n{STEPS_25}    checks:\n{TTFT}"
    )
    capped = pkit.build("demo-cmax", knee_ttft=0.9, knee_goodput=3.0)
    res = promote_progressive(pkit.settings, capped, env="staging", dry_run=True)
    assert res.report is not None and not res.report.passed
    assert [g.name for g in res.report.failed] == ["bench.knee.ttft_p95_s"]

"""Evidence bound to the release's signed record, and evidence that says where it was
measured: a release's eval, bench, comparison and manifest copy are read only as its
`register` ledger event signed them (a swapped or edited file fails the evidence gate naming
it); a perf comparison is made only between load tests of one host kind and core count; a
knee applies only to replicas with the cores it was measured on; `max_perf_spread` stays
below the point where a halved goodput would pass. Releases are promote_kit's (real files
written by the real writers, registered in a real MLflow store and SQLite ledger)."""

from __future__ import annotations

import json

import pytest
from promote_kit import GOODPUT_LINE, KIT_HOST, Kit, kit
from pydantic import ValidationError

from releasekit.config import EnvironmentConfig, RayAutoscaling
from releasekit.deploy.ray.autoscale import NoKneeEvidenceError, plan_for
from releasekit.promote.context import ReleaseContextError, load_release, release_knee
from releasekit.promote.gates import GateReport, GateResult, evaluate_gates
from releasekit.releases.register import register_release
from releasekit.spec.lock import lock
from releasekit.stores.ledger import EventType, Ledger
from releasekit.stores.results import ReleasePaths
from releasekit.stores.verified import verify_release_evidence

__all__ = ["kit"]


def _ledger(k: Kit) -> Ledger:
    return Ledger(k.settings.ledger_url or "")


def _gates(
    k: Kit, cand: str, live: str | None, policy: EnvironmentConfig | None = None
) -> GateReport:
    led = _ledger(k)
    ci = load_release(k.settings, k.rids[cand], ledger=led)
    li = load_release(k.settings, k.rids[live], ledger=led) if live else None
    return evaluate_gates(k.settings, env="staging", candidate=ci, live=li, policy=policy)


def _gate(rep: GateReport, name: str) -> GateResult:
    return next(g for g in rep.gates if g.name == name)


def _register_seq(k: Kit, name: str) -> int:
    recs = _ledger(k).records(release=k.rids[name], types=[EventType.REGISTER.value])
    return recs[-1].seq


def test_eval_results_copied_from_another_release_fail_the_evidence_gate_naming_the_file(
    kit: Kit,
) -> None:
    """The attack: a good release's eval.json and items.jsonl copied over a damaged one's,
    the release id rewritten. Every figure now says "as good as live", but the files are
    not the ones the damaged release's register event signed: its eval evidence gate fails,
    naming the file and the record, and no quality gate passes on them."""
    kit.build("demo-bf16")
    kit.build("demo-damaged-prompt", fail={"core": 60})
    good = ReleasePaths.of(kit.settings, kit.rids["demo-bf16"])
    bad = ReleasePaths.of(kit.settings, kit.rids["demo-damaged-prompt"])
    bid, did = kit.rids["demo-bf16"], kit.rids["demo-damaged-prompt"]
    bad.eval.write_text(good.eval.read_text().replace(bid, did))
    items = good.eval_dir / "items.jsonl"
    (bad.eval_dir / "items.jsonl").write_text(items.read_text().replace(bid, did))
    rep = _gates(kit, "demo-damaged-prompt", "demo-bf16")
    assert not rep.passed
    ev = _gate(rep, "eval evidence (candidate)")
    seq = _register_seq(kit, "demo-damaged-prompt")
    want = (
        f"results/{did}/eval/eval.json differs from the digest release {did[:12]}'s "
        f"register event #{seq} signed"
    )
    assert not ev.passed and want in ev.detail, ev.detail
    assert not any(g.passed for g in rep.gates if g.kind == "quality")
    # The good release's own evidence is untouched and still verifies.
    assert verify_release_evidence(kit.settings, bid, _ledger(kit)).ok


def test_an_unregistered_release_fails_every_evidence_gate(kit: Kit) -> None:
    """A built release that was never registered has nothing signing its evidence."""
    kit.build("demo-bf16", register=False)
    rep = _gates(kit, "demo-bf16", None)
    ev = _gate(rep, "eval evidence (candidate)")
    assert not ev.passed and "has no register event" in ev.detail
    assert not _gate(rep, "bench evidence (candidate)").passed and not rep.passed


def test_an_edited_manifest_copy_is_refused_naming_it(kit: Kit) -> None:
    """The manifest copy (whose gates, canary, shadow and watch settings decide) edited after
    registration: the release cannot be loaded for a promotion, a watch or a canary, and
    the error names the file and what to do."""
    rid = kit.build("demo-bf16")
    copy = ReleasePaths.of(kit.settings, rid).manifest
    copy.write_text(copy.read_text().replace("margin: 0.05", "margin: 0.5"))
    with pytest.raises(ReleaseContextError) as err:
        load_release(kit.settings, rid, ledger=_ledger(kit))
    assert f"results/{rid}/manifest.yaml differs from the digest" in err.value.message
    assert "restore the file" in err.value.remedy


def test_a_manifest_edited_after_registration_with_the_same_release_id_fails_the_gate(
    kit: Kit,
) -> None:
    """Relaxing the project's manifest (its gates are not in the release id) after the
    release was registered, then locking it again, keeps the release id: promote judges
    by the signed copy, and an evidence gate says the edit does not apply and what to do."""
    rid = kit.build("demo-bf16")
    path = kit.manifest("demo-bf16")
    path.write_text(path.read_text().replace(GOODPUT_LINE, ""))
    assert lock(path, root=kit.root).release_id == rid  # same release, other rules
    rep = _gates(kit, "demo-bf16", None)
    g = _gate(rep, "manifest as registered")
    assert not g.passed and "was edited after release" in g.detail
    assert "git checkout -- manifests/demo-bf16.yaml" in g.detail and not rep.passed


def test_a_swapped_bench_gives_no_knee_for_autoscaling(kit: Kit) -> None:
    """bench.json copied from another release (release id rewritten): the knee the
    autoscaler would derive replicas from is refused, naming the file."""
    kit.build("demo-bf16")
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", knee_goodput=4.0)
    a, b = kit.rids["demo-bf16"], kit.rids["demo-v2"]
    src, dst = (ReleasePaths.of(kit.settings, r).bench for r in (a, b))
    dst.write_text(src.read_text().replace(a, b))
    info = load_release(kit.settings, b, ledger=_ledger(kit))
    knee, problem = release_knee(kit.settings, info)
    assert knee is None and f"results/{b}/bench/bench.json differs from the digest" in problem
    auto = RayAutoscaling(target="knee", knee_headroom=0.25, max_replicas=2)
    with pytest.raises(NoKneeEvidenceError, match=r"bench\.json differs"):
        plan_for("staging", auto, b, knee, problem, replica_cpus=1.0)


def test_a_perf_comparison_across_host_kinds_or_core_counts_fails_as_evidence(
    kit: Kit,
) -> None:
    """A candidate benched on another CPU kind (or core count) than live: no perf verdict is
    drawn from the two load tests; an evidence gate says "benched on another host" and what
    to do. Quality is still judged (exact answers of a deterministic model)."""
    kit.build("demo-bf16")
    other = KIT_HOST.model_copy(update={"cpu_vendor": "GenuineIntel", "isa": "avx2"})
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", host=other)
    more = KIT_HOST.model_copy(update={"cores": 4})
    kit.variant("demo-bf16", "demo-v3", {"max-num-seqs: 32": "max-num-seqs: 8"})
    kit.build("demo-v3", host=more)
    for cand, why in (("demo-v2", "another host kind"), ("demo-v3", "another core count")):
        rep = _gates(kit, cand, "demo-bf16")
        g = _gate(rep, "benched on the same host kind as live")
        assert g.kind == "evidence" and not g.passed and g.against_live
        assert "benched on another host" in g.detail and why in g.detail
        assert "rebench live beside it" in g.detail
        assert not any(x.name == "goodput at the knee" for x in rep.gates)
        assert _gate(rep, "suite core").passed  # quality is not judged by CPU kind
    same = _gates(kit, "demo-v3", "demo-v3")  # one host: compared as before
    assert not any(x.name.startswith("benched on") for x in same.gates)


def test_a_knee_from_another_core_count_is_refused_by_the_autoscaler(kit: Kit) -> None:
    """A knee measured on 2 cores is not applied to 1-CPU replicas: a promotion is refused,
    a rollback (fixed_without_knee) runs max_replicas, and matching cores scale from it."""
    two = KIT_HOST.model_copy(update={"cores": 2})
    rid = kit.build("demo-bf16", host=two)
    info = load_release(kit.settings, rid, ledger=_ledger(kit))
    knee, problem = release_knee(kit.settings, info)
    assert knee is not None and knee.cores == 2 and not problem
    auto = RayAutoscaling(target="knee", knee_headroom=0.25, max_replicas=3)
    with pytest.raises(NoKneeEvidenceError, match="measured on 2 cores"):
        plan_for("staging", auto, rid, knee, None, replica_cpus=1.0)
    fixed = plan_for("staging", auto, rid, knee, None, replica_cpus=1.0, fixed_without_knee=True)
    assert fixed.source == "fixed at max" and "2 cores" in (fixed.why_fixed or "")
    plan = plan_for("staging", auto, rid, knee, None, replica_cpus=2.0)
    assert plan.source == "knee" and plan.target_in_flight == 12.0


def test_max_perf_spread_cannot_let_a_halved_goodput_pass(kit: Kit) -> None:
    """0.5 (where goodput at half of live would meet live x (1 - 0.5)) is refused as a
    setting; at the widest spread allowed, a candidate with half the live goodput fails."""
    with pytest.raises(ValidationError, match=r"less than 0\.5"):
        EnvironmentConfig(port=1, max_perf_spread=0.5)
    kit.build("demo-bf16", register=False)
    bench = ReleasePaths.of(kit.settings, kit.rids["demo-bf16"]).bench
    data = json.loads(bench.read_text())
    for point in [*data["points"], data["knee"]]:
        if point["load"] == 16:
            point["spread"]["goodput"] = {"n": 3, "min": 4.2, "median": 8.0, "max": 8.12}
    bench.write_text(json.dumps(data))
    register_release(kit.settings, kit.manifest("demo-bf16"))
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", knee_goodput=4.0)
    widest = EnvironmentConfig(port=1, max_perf_spread=0.49)
    g = _gate(_gates(kit, "demo-v2", "demo-bf16", widest), "goodput at the knee")
    assert not g.passed and g.candidate == 4.0 and g.limit is not None and g.limit > 4.0


def test_a_register_event_recorded_after_a_crash_signs_the_digests(kit: Kit) -> None:
    """The version exists in MLflow but its register event was never written (a crash in
    between): registering again records the event now, with the evidence digests and the
    manifest copy's digest, so the release's evidence verifies against it."""
    rid = kit.build("demo-bf16")
    fresh = kit.root / ".releasekit" / "other-ledger.db"
    led = Ledger(f"sqlite:///{fresh}")
    res = register_release(kit.settings, kit.manifest("demo-bf16"), ledger=led)
    assert not res.created and res.ledger_seq == 1
    rec = led.records(types=[EventType.REGISTER.value])[0]
    assert rec.evidence["reports"]["eval/eval.json"]
    assert rec.evidence["manifest_digest"] == rec.evidence["reports"]["manifest.yaml"]
    assert verify_release_evidence(kit.settings, rid, led).ok

"""A load test measured once per engine (releasekit.bench.reuse): a release whose engine,
load profile, served name and harness are a registered release's, on the same host kind,
cites that release's main sweep as its register event signed it instead of running it again;
the citation is checked wherever the bench decides. Releases are promote_kit's (real files
written by the real writers, registered in a real MLflow store and SQLite ledger); the
citing bench is made by the functions the build's evidence stage calls."""

from __future__ import annotations

import json

from promote_kit import KIT_HOST, Kit, kit

from releasekit.bench.reuse import bench_key, check_citation, find_measurement
from releasekit.bench.runner import BenchResult
from releasekit.promote.context import load_release
from releasekit.promote.gates import GateReport, GateResult, evaluate_gates
from releasekit.spec.lock import lock, serving_key
from releasekit.spec.measured import MeasuredOn
from releasekit.stores.ledger import EventType, Ledger
from releasekit.stores.results import ReleasePaths

__all__ = ["kit"]


def _ledger(k: Kit) -> Ledger:
    return Ledger(k.settings.ledger_url or "")


def _bench(k: Kit, name: str) -> BenchResult:
    return BenchResult.model_validate_json(
        ReleasePaths.of(k.settings, k.rids[name]).bench.read_bytes()
    )


def _gates(k: Kit, cand: str, live: str | None) -> GateReport:
    led = _ledger(k)
    ci = load_release(k.settings, k.rids[cand], ledger=led)
    li = load_release(k.settings, k.rids[live], ledger=led) if live else None
    return evaluate_gates(k.settings, env="staging", candidate=ci, live=li)


def _gate(rep: GateReport, name: str) -> GateResult:
    return next(g for g in rep.gates if g.name == name)


def test_a_release_on_the_same_engine_cites_the_registered_load_test(kit: Kit) -> None:
    """demo-damaged-prompt differs from demo-bf16 in its prompt alone (one serving key, one
    load profile): its build cites bf16's main sweep, figure for figure, naming the release,
    its register event and the digest that event signed; the citing release's gates read it
    as its own evidence and pass. demo-w8a8 (another engine) measures its own."""
    bf16 = kit.build("demo-bf16", knee_ttft=0.31)
    lk_bf16 = lock(kit.manifest("demo-bf16"), root=kit.root)
    lk_dmg = lock(kit.manifest("demo-damaged-prompt"), root=kit.root)
    assert serving_key(lk_bf16) == serving_key(lk_dmg)
    assert bench_key(lk_bf16, "demo") == bench_key(lk_dmg, "demo")
    kit.build("demo-damaged-prompt", reuse=True, knee_ttft=0.99)
    mine, theirs = _bench(kit, "demo-damaged-prompt"), _bench(kit, "demo-bf16")
    assert mine.release_id == kit.rids["demo-damaged-prompt"]
    assert mine.measured_for is not None and mine.measured_for.release_id == bf16
    seq = _ledger(kit).records(release=bf16, types=[EventType.REGISTER.value])[-1].seq
    assert mine.measured_for.register_seq == seq
    assert mine.points == theirs.points and mine.knee == theirs.knee
    assert mine.knee is not None and mine.knee.ttft.p95 == 0.31  # bf16's, not its own 0.99
    assert theirs.measured_for is None
    rep = _gates(kit, "demo-damaged-prompt", "demo-bf16")
    assert _gate(rep, "bench evidence (candidate)").passed
    perf = [g for g in rep.gates if g.kind == "perf"]
    assert perf and all(g.passed for g in perf), perf
    # The report says the two figures are one measurement, not two that agreed.
    against = [g for g in perf if g.against_live]
    assert against and all(f"one load test, release {bf16[:12]}'s" in g.detail for g in against)
    # Another engine (quantised weights) has another key: it measures its own.
    kit.build("demo-w8a8", reuse=True)
    assert _bench(kit, "demo-w8a8").measured_for is None


def test_a_load_test_swapped_after_registration_is_never_cited_and_its_citations_fail(
    kit: Kit,
) -> None:
    """bf16's bench.json edited after registration (a better knee): no later build cites it,
    and the release that cited it before fails its bench evidence gate, naming the file."""
    bf16 = kit.build("demo-bf16")
    kit.build("demo-damaged-prompt", reuse=True)
    assert _bench(kit, "demo-damaged-prompt").measured_for is not None
    path = ReleasePaths.of(kit.settings, bf16).bench
    data = json.loads(path.read_text())
    data["knee"]["goodput"] = 99.0
    path.write_text(json.dumps(data))
    rep = _gates(kit, "demo-damaged-prompt", None)
    gate = _gate(rep, "bench evidence (candidate)")
    assert not gate.passed
    assert f"the load test it cites (release {bf16[:12]}) cannot be checked" in gate.detail
    assert f"results/{bf16}/bench/bench.json differs from the digest" in gate.detail
    lk = lock(kit.manifest("demo-damaged-prompt"), root=kit.root)
    assert find_measurement(kit.settings, lk, "demo", ledger=_ledger(kit), host=KIT_HOST) is None


def test_a_load_test_of_another_host_kind_or_an_unregistered_one_is_not_cited(kit: Kit) -> None:
    """A sweep measured on another host kind, or one no register event signed, is no
    measurement of this engine here: the build measures."""
    other = MeasuredOn(cpu_vendor="GenuineIntel", cpu_model="Xeon (test)", isa="amx", cores=1)
    kit.build("demo-bf16", host=other)
    lk = lock(kit.manifest("demo-damaged-prompt"), root=kit.root)
    led = _ledger(kit)
    assert find_measurement(kit.settings, lk, "demo", ledger=led, host=KIT_HOST) is None
    assert find_measurement(kit.settings, lk, "demo", ledger=led, host=other) is not None
    assert find_measurement(kit.settings, lk, "other-name", ledger=led, host=other) is None
    kit.build("demo-bf16", host=KIT_HOST, register=False)  # rewritten, not registered again
    assert find_measurement(kit.settings, lk, "demo", ledger=led, host=KIT_HOST) is None


def test_a_citation_whose_sweep_was_altered_before_registration_fails(kit: Kit) -> None:
    """The citing release's bench.json names bf16's load test but carries other figures
    (edited before it was registered, so its own register event signs the edit): the
    citation check compares it with the cited sweep figure for figure and the gate fails."""
    kit.build("demo-bf16")
    kit.build("demo-damaged-prompt", reuse=True, register=False)
    paths = ReleasePaths.of(kit.settings, kit.rids["demo-damaged-prompt"])
    data = json.loads(paths.bench.read_text())
    data["knee"]["goodput"] = 99.0
    paths.bench.write_text(json.dumps(data))
    from releasekit.releases.register import register_release

    register_release(kit.settings, kit.manifest("demo-damaged-prompt"))
    bench = _bench(kit, "demo-damaged-prompt")
    lk = lock(kit.manifest("demo-damaged-prompt"), root=kit.root)
    why = check_citation(kit.settings, bench, lk, _ledger(kit))
    assert why is not None and "differs from release" in why
    rep = _gates(kit, "demo-damaged-prompt", None)
    assert not _gate(rep, "bench evidence (candidate)").passed

"""Capacity plans from a release's signed evidence: `releasekit capacity RELEASE` reads
bench.json and the manifest copy only as the release's `register` event signed them (a
swapped file is one clear line naming it, and nothing is written); a release built but not
registered is planned from its files as they are, with a visible "unverified" note; a knee
measured on another core count than a replica's is refused, or scaled when asked. Releases
are promote_kit's (real files written by the real writers, registered in a real MLflow store
and SQLite ledger)."""

from __future__ import annotations

import json

import pytest
from promote_kit import KIT_HOST, Kit, kit
from typer.testing import CliRunner

from releasekit.capacity import CapacityEvidenceError, Traffic, plan_release
from releasekit.capacity.diagnose_lookups import live_baseline
from releasekit.capacity.replicas import replica_plan
from releasekit.cli import app
from releasekit.cli._common import State
from releasekit.config import EnvironmentConfig
from releasekit.stores.ledger import EventType, Ledger
from releasekit.stores.results import ReleasePaths

__all__ = ["kit"]

TRAFFIC = Traffic(daily_requests=100_000, peak_hours=2, peak_factor=2)
ARGS = ["--daily-requests", "100000", "--peak-hours", "2", "--peak-factor", "2"]


def _capacity(*args: str) -> tuple[int, str]:
    State.reset()
    res = CliRunner().invoke(app, ["capacity", *args])
    return res.exit_code, res.output


def _register_seq(k: Kit, rid: str) -> int:
    led = Ledger(k.settings.ledger_url or "")
    return led.records(release=rid, types=[EventType.REGISTER.value])[-1].seq


def test_a_registered_release_is_planned_from_its_signed_bench(kit: Kit) -> None:
    rid = kit.build("demo-bf16")
    plan = plan_release(kit.settings, rid, TRAFFIC)
    assert plan.verified is True and not any("unverified" in n for n in plan.notes)
    assert plan.unit.measured_on == KIT_HOST and plan.unit.cores == 1
    assert any(n.startswith("a unit is one engine as benched: AMD EPYC") for n in plan.notes)
    code, out = _capacity(rid[:12], *ARGS, "--no-plot")
    assert code == 0 and "units" in out and "unverified" not in out, out


def test_a_swapped_bench_is_refused_naming_the_file_and_nothing_is_written(kit: Kit) -> None:
    """bench.json copied from a release with twice the goodput (its id rewritten): the plan
    would need half the units. It is not the file the register event signed: one line
    naming it, exit 1, no plot written."""
    kit.build("demo-bf16")
    kit.variant("demo-bf16", "demo-v2", {"max-num-seqs: 32": "max-num-seqs: 16"})
    kit.build("demo-v2", knee_goodput=16.0)
    rid, other = kit.rids["demo-bf16"], kit.rids["demo-v2"]
    mine, theirs = ReleasePaths.of(kit.settings, rid), ReleasePaths.of(kit.settings, other)
    mine.bench.write_text(theirs.bench.read_text().replace(other, rid))
    with pytest.raises(CapacityEvidenceError) as err:
        plan_release(kit.settings, rid, TRAFFIC)
    seq = _register_seq(kit, rid)
    want = (
        f"results/{rid}/bench/bench.json differs from the digest release {rid[:12]}'s "
        f"register event #{seq} signed"
    )
    assert want in err.value.message and "restore the file" in err.value.remedy
    code, out = _capacity(rid[:12], *ARGS)
    assert code == 1 and want in " ".join(out.split()) and "Traceback" not in out, out
    assert not (mine.root / "capacity.png").exists()
    # diagnose takes no knee from it either, and says why
    base, why = live_baseline(kit.settings, rid)
    assert base is None and why is not None and "bench/bench.json differs" in why


def test_an_edited_manifest_copy_is_refused(kit: Kit) -> None:
    rid = kit.build("demo-bf16")
    copy = ReleasePaths.of(kit.settings, rid).manifest
    copy.write_text(copy.read_text().replace("max-num-seqs: 32", "max-num-seqs: 256"))
    with pytest.raises(CapacityEvidenceError, match=r"manifest\.yaml differs from the digest"):
        plan_release(kit.settings, rid, TRAFFIC)


def test_an_unregistered_build_is_planned_with_an_unverified_note(kit: Kit) -> None:
    rid = kit.build("demo-bf16", register=False)
    plan = plan_release(kit.settings, rid, TRAFFIC)
    assert plan.verified is False
    assert plan.notes[0].startswith(f"unverified: release {rid[:12]} is not registered")
    code, out = _capacity(rid[:12], *ARGS, "--no-plot")
    assert code == 0 and "unverified: release" in out, out
    base, why = live_baseline(kit.settings, rid)
    assert base is not None and why is not None and why.startswith("unverified")


def test_a_knee_from_another_core_count_is_refused_or_scaled_when_asked(kit: Kit) -> None:
    """The kit benches on 1 core; a ray replica here gets 2 CPUs."""
    rid = kit.build("demo-bf16")
    with pytest.raises(CapacityEvidenceError) as err:
        plan_release(kit.settings, rid, TRAFFIC, unit_cores=2)
    assert "measured on AMD EPYC (test) (avx512_bf16), 1 core" in err.value.message
    assert "2 CPU" in err.value.message and "--scale-cores" in err.value.remedy
    same = plan_release(kit.settings, rid, TRAFFIC, unit_cores=1)
    scaled = plan_release(kit.settings, rid, TRAFFIC, unit_cores=2, scale_cores=True)
    assert scaled.unit.requests_per_s == pytest.approx(2 * same.unit.requests_per_s)
    assert scaled.units <= same.units and scaled.unit.cores == 2
    assert scaled.warnings[0].code == "cores_scaled"
    assert any(s.name == "per-unit rate scaled to the unit's cores" for s in scaled.steps)

    # A plan made without the replica's cores is not turned into replicas of another size.
    ray = EnvironmentConfig.model_validate(
        {
            "port": 8790,
            "target": "ray",
            "ray": {"address": "127.0.0.1:6390", "replicas": 1, "cpus_per_replica": 2},
        }
    )
    settings = kit.settings.model_copy(update={"environments": {"cluster": ray}})
    with pytest.raises(CapacityEvidenceError, match="across core counts"):
        replica_plan(settings, "cluster", same, release=rid)
    assert replica_plan(settings, "cluster", scaled, release=rid).replicas == scaled.units


def test_a_bench_without_a_host_cannot_be_matched_to_a_replica(kit: Kit) -> None:
    rid = kit.build("demo-bf16", register=False)
    bench = ReleasePaths.of(kit.settings, rid).bench
    data = json.loads(bench.read_text())
    data.pop("host", None)
    bench.write_text(json.dumps(data))
    plan = plan_release(kit.settings, rid, TRAFFIC)
    assert any("records no host" in n for n in plan.notes)
    with pytest.raises(CapacityEvidenceError, match="records no host"):
        plan_release(kit.settings, rid, TRAFFIC, unit_cores=1, scale_cores=True)

"""Promote refuses the weights and prompts whose live answers breached, whatever release
carries them: the same weights repackaged with one serving variable changed are blocked by
the quality gate "answers breach of these weights" until forced (`--force quality` with a
reason)."""

from __future__ import annotations

from promote_kit import Kit, kit

from releasekit.promote.answers_breach import GATE_NAME, answers_key
from releasekit.promote.promote import promote
from releasekit.spec.lock import lock
from releasekit.stores.ledger import Event, EventType, open_ledger

__all__ = ["kit"]

V2_SERVING = {"max-num-seqs: 32": "max-num-seqs: 16"}
V21_SERVING = {**V2_SERVING, 'VLLM_CPU_KVCACHE_SPACE: "1"': 'VLLM_CPU_KVCACHE_SPACE: "2"'}


def _shadow_breach(k: Kit, name: str, *, stable: str) -> int:
    """The shadow comparison of `name` in staging, as its writer records an answers breach
    (the verdict and the key of the weights it judged)."""
    inputs = lock(k.manifest(name), root=k.root).inputs
    led = open_ledger(k.settings)
    rec = led.append(
        Event(
            type=EventType.SHADOW,
            environment="staging",
            from_release=stable,
            to_release=k.rids[name],
            reason="shadow comparison: breach",
            evidence={
                "action": "compare",
                "answers": {"comparison": "exact", "verdict": "breach", "reason": "worse"},
                "answers_key": answers_key(inputs),
            },
        )
    )
    return rec.seq


def test_the_same_weights_repackaged_are_refused_until_forced(kit: Kit) -> None:
    old = kit.build("demo-bf16")
    assert promote(kit.settings, old, env="staging", reason="base").status == "promoted"
    kit.variant("demo-bf16", "demo-v2", V2_SERVING)
    kit.build("demo-v2")
    seq = _shadow_breach(kit, "demo-v2", stable=old)
    kit.variant("demo-bf16", "demo-v2-1", V21_SERVING)
    repackaged = kit.build("demo-v2-1")

    res = promote(kit.settings, repackaged, env="staging")
    assert res.status == "blocked" and res.report is not None
    [gate] = [g for g in res.report.gates if g.name == GATE_NAME]
    assert gate.kind == "quality" and not gate.passed
    assert gate.detail.startswith(f"record {seq} in staging: release {kit.rids['demo-v2'][:12]}")
    assert res.record is not None and GATE_NAME in res.record.evidence["gates"]["failed"]

    perf_only = promote(kit.settings, repackaged, env="staging", force=["perf"], reason="no")
    assert perf_only.status == "blocked"
    forced = promote(
        kit.settings, repackaged, env="staging", force=["quality"], reason="judged noise"
    )
    assert forced.status == "promoted" and forced.overridden == [GATE_NAME]

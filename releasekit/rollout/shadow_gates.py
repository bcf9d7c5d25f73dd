"""The shadow's gates: the admission checks before a candidate's requests are mirrored
(what `promote` would consider), and the "shadow comparison" gate `promote` reads from the
ledger once a candidate was shadowed."""

from __future__ import annotations

import datetime as dt
from collections import Counter

from releasekit.config import Settings
from releasekit.promote.approvals import approval_gate_for
from releasekit.promote.context import ReleaseInfo
from releasekit.promote.deploy import env_config
from releasekit.promote.gates import GateResult
from releasekit.promote.promote import policy_gates
from releasekit.stores.ledger import EventType, Ledger, open_ledger


def shadow_admission(
    settings: Settings, info: ReleaseInfo, *, env: str, ledger: Ledger
) -> list[GateResult]:
    """The checks promote makes before it considers `info` for `env` that fail: the
    manifest lists the environment, the release is registered, not marked bad, live first
    where required, and approved where the environment requires approval."""
    cfg = env_config(settings, env)
    gates: list[GateResult] = []
    allowed = [e.name for e in info.lm.manifest.environments]
    gates.append(
        GateResult(
            name=f"may go to {env}",
            kind="policy",
            passed=env in allowed,
            rule="the release's manifest lists the environment",
            detail="ok" if env in allowed else f"its manifest lists {', '.join(allowed)}",
        )
    )
    regs = ledger.records(release=info.release_id, types=[EventType.REGISTER.value])
    registered = any(r.to_release == info.release_id for r in regs)
    gates.append(
        GateResult(
            name="registered",
            kind="policy",
            passed=registered,
            rule="the release is registered (`releasekit register`)",
            detail="ok" if registered else "no register event in the ledger",
        )
    )
    gates += policy_gates(settings, info, env=env, ledger=ledger)
    if cfg.requires_approval:
        gates.append(approval_gate_for(ledger, info.release_id, env))
    return [g for g in gates if not g.passed]


def shadow_gate(
    settings: Settings,
    *,
    env: str,
    release_id: str,
    ledger: Ledger | None = None,
    now: dt.datetime | None = None,
) -> GateResult | None:
    """The "shadow comparison" gate of `release_id` in `env`, from the ledger: None when it
    was never shadowed there; once it was (a `shadow` start event), it passes only with a
    passing comparison against the release live now, at most `shadow_max_age_s` old."""
    led = ledger or open_ledger(settings, read_only=True)
    recs = [
        r
        for r in led.records(environment=env, release=release_id, types=[EventType.SHADOW.value])
        if r.to_release == release_id
    ]
    starts = [r for r in recs if r.evidence.get("action") == "start"]
    if not starts:
        return None
    compares = [r for r in recs if r.evidence.get("action") == "compare"]
    live = led.live_at(env)
    stable = live.to_release if live else None
    max_age = env_config(settings, env).shadow_max_age_s
    rule = (
        "once shadowed, the candidate is no worse than the stable release live now on "
        f"mirrored traffic (canary checks, answer agreement), judged at most {max_age:g} s ago"
    )
    if not compares:
        return GateResult(
            name="shadow comparison",
            kind="shadow",
            passed=False,
            rule=rule,
            detail=f"shadowed in {env} (record {starts[-1].seq}) but no comparison is "
            f"recorded; run `releasekit shadow compare --env {env}`",
        )
    last = compares[-1]
    t = now or dt.datetime.now(dt.UTC)
    age = (t - last.time).total_seconds()
    tally = ", ".join(
        f"{n} {v}" for v, n in Counter(str(r.evidence.get("verdict")) for r in compares).items()
    )
    seen = f"(record {last.seq}; {len(compares)} comparisons: {tally})"
    verdict = str(last.evidence.get("verdict"))
    if last.from_release != stable:
        passed = False
        detail = (
            f"the last comparison was against {(last.from_release or '-')[:12]}, but "
            f"{(stable or 'nothing')[:12]} is live in {env} now {seen}; compare again"
        )
    elif age > max_age:
        passed = False
        detail = f"the last comparison is {age:.0f} s old, over {max_age:g} s {seen}; compare again"
    else:
        passed = verdict == "pass"
        detail = (
            f"{verdict} over {last.evidence.get('window_s', 0):g} s, {age:.0f} s ago "
            f"{seen}: {last.evidence.get('detail', '')}"
        )
    return GateResult(
        name="shadow comparison",
        kind="shadow",
        passed=passed,
        rule=rule,
        detail=detail[:2000],
    )

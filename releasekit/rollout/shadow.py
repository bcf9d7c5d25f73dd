"""Shadow traffic: a candidate gets a copy of a share of an environment's live requests,
its answers reach no client, and its live figures and its answers are compared with the
stable release's.

    start_shadow(settings, "manifests/demo-w8a8.yaml", env="staging", share=0.2)
    comparison = compare_shadow(settings, env="staging", window_s=30)
    stop_shadow(settings, env="staging")

The candidate's server runs beside the environment's (role `shadow` in the deploy state)
and the gateway's table gets a `mirror` (`deploy.gateway.mirror`): copies take no client
rate-limit token and no in-flight slot, and past the environment's `shadow_max_in_flight`
they are dropped, never queued, so the live release's users do not wait for them. The
comparison judges the candidate against stable over the same window with the candidate
manifest's canary checks (`rollout.judge`), as a canary step is judged: after the same
warm-up burst to the candidate's server and `settle_s`, both servers at the same priority
and placement (`rollout.placement`). A promote or rollback replaces the table, which ends
the mirroring.

With `baseline: fresh` in the candidate's canary policy (as for its canary steps), a fresh
server of the stable release starts with the shadow and the gateway sends it the same
copies at the same moment, under its own label (`Mirror.baseline`): the candidate's figures
are compared with that server's, both fresh and both loaded alike, not with the live server
that has run for hours beside other work. The comparison says which it was judged against.

The comparison also judges answers: the gateway keeps, for each mirrored request, the
answer the client got from stable and the candidate's (`GET /admin/mirror/pairs`; the
prompt text only where the environment's `shadow_keep_prompts` allows, else a digest).
The pairs completed in the window are compared (`releasekit.evaluate.agreement`: exact
agreement after the suites' normalisation, a Wilson interval; a request that samples,
without `temperature` 0, is not judged: two samples may differ by chance); fewer than the policy's
`shadow_min_pairs` is `insufficient`, an interval wholly below `shadow_min_agreement` a
`breach`, with up to 10 disagreeing pairs in the ledger event's evidence. Both fields are
the environment's committed policy (`releasekit.promote.policy`): a command's own settings
that differ from it are refused.

A local environment's gateway also keeps the pairs on disk, bounded
(`<state dir>/mirror-pairs/<env>/`, `deploy.gateway.pairstore`): the durable copy, read
here when the gateway's memory no longer holds the window (more pairs than its ring, or a
gateway restart in between). Each comparison is written beside its JSON copy as an HTML
page (`rollout.report`): verdict, agreement and interval, the checks, and the disagreeing
pairs side by side.

What the shadow may do and what it proves:
- `start_shadow` copies users' requests to a candidate only if `promote` would consider it
  for that environment: registered, its manifest lists the environment, not marked bad,
  live first where the policy `requires` it, and approved where approval is required
  (ledger records verified first); otherwise nothing is mirrored.
- every comparison is a signed `shadow` ledger event (`action: compare`) bound to the
  stable release it was judged against. Once a candidate was shadowed in an environment
  (a `shadow` start event), `promote` of it there passes the "shadow comparison" gate only
  with a passing comparison against the release live now, at most `shadow_max_age_s` old;
  none, an expired one, or one against another stable release fails it. The gate reads the
  ledger: the local JSON copy of a comparison decides nothing.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from releasekit._support.files import write_atomic
from releasekit._support.http import http_client
from releasekit.config import Settings
from releasekit.deploy.gateway import (
    GatewayError,
    GatewayState,
    Mirror,
    MirrorPair,
    Route,
    RouteTable,
    prune,
    read_pairs,
    store_dir,
)
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.local import LocalTarget
from releasekit.deploy.state import EnvState, locked_state, read_state
from releasekit.deploy.target import ReleaseSpec, ReleaseStartError, Upstream
from releasekit.errors import ReleasekitError
from releasekit.evaluate.agreement import Agreement, answer_agreement
from releasekit.promote.approvals import approval_gate_for
from releasekit.promote.ceilings import checks_within, clamp_note
from releasekit.promote.context import ReleaseInfo, load_release, release_spec
from releasekit.promote.deploy import ShiftContext, env_config, target_for
from releasekit.promote.gates import GateResult
from releasekit.promote.policy import environment_policy
from releasekit.promote.promote import policy_gates
from releasekit.releases.resolve import resolve_release
from releasekit.rollout.baseline import baseline_method
from releasekit.rollout.canary import (
    SHARED_SERVER,
    Scrape,
    baseline_label,
    pair_windows,
    scrape_pair,
    warm_up_server,
)
from releasekit.rollout.inputs import judged_inputs
from releasekit.rollout.judge import StepJudgement, judge_step
from releasekit.rollout.placement import even_out, release
from releasekit.rollout.report import write_shadow_page
from releasekit.spec.manifest import Canary, CanaryCheck, default_checks
from releasekit.stores.ledger import Event, EventType, Ledger, open_ledger
from releasekit.watch.pairs import answer_pair

ShadowVerdict = Literal["pass", "breach", "insufficient"]


class ShadowError(ReleasekitError):
    """Raised when shadowing cannot start or be read: nothing serves the environment, the
    candidate already takes traffic there, its server did not start, or no shadow runs."""

    remedy = "promote a release to the environment first; `releasekit shadow start` a candidate"


class ShadowStatus(BaseModel):
    """The shadow in force in one environment."""

    env: str
    release_id: str
    stable_release_id: str | None
    share: float
    base_url: str
    started_at: float
    reused_server: bool = False
    baseline_url: str | None = Field(
        None, description="the fresh baseline server of stable that gets the same copies"
    )


class ShadowComparison(BaseModel):
    """The candidate's live figures against stable's over one window."""

    env: str
    release_id: str
    stable_release_id: str
    verdict: ShadowVerdict
    window_s: float
    at: float
    judgement: StepJudgement
    mirrored: int = Field(0, description="copies sent in the window")
    dropped: int = Field(0, description="copies dropped in the window (mirror at its cap)")
    reason: str = ""
    seq: int | None = Field(None, description="the ledger record of this comparison")
    agreement: Agreement | None = Field(
        None, description="the answers' agreement on the window's mirrored requests"
    )
    judged_against: Literal["fresh baseline", "live server"] = Field(
        "live server",
        description="what the candidate's figures were compared with: a fresh server of "
        "stable given the same copies, or the long-running live server",
    )
    page: str | None = Field(
        None, description="the comparison's HTML page (disagreeing pairs side by side)"
    )
    clamped: str = Field(
        "",
        description="what of the checks the environment's ceilings clamped "
        "(rollout.ceilings: 'clamped by staging's policy: ...'; empty: none)",
    )


def _dir(settings: Settings) -> Path:
    return settings.state_dir / "shadow"


def read_shadow(settings: Settings, env: str) -> ShadowStatus | None:
    """The shadow running in `env`, or None."""
    try:
        return ShadowStatus.model_validate_json((_dir(settings) / f"{env}.json").read_bytes())
    except (OSError, ValidationError, ValueError):
        return None


def read_comparison(settings: Settings, env: str, release_id: str) -> ShadowComparison | None:
    """The latest shadow comparison of `release_id` in `env`, or None."""
    path = _dir(settings) / f"{env}-{release_id[:16]}.comparison.json"
    try:
        cmp = ShadowComparison.model_validate_json(path.read_bytes())
    except (OSError, ValidationError, ValueError):
        return None
    return cmp if cmp.release_id == release_id else None


def _client(settings: Settings, env: str) -> GatewayClient:
    gw = read_state(settings.state_dir, env).gateway
    if gw is None:
        raise ShadowError(f"{env} has no gateway running: nothing serves it")
    return GatewayClient(gw.url, admin_token=gw.admin_token)


def start_shadow(
    settings: Settings,
    release_ref: str,
    *,
    env: str,
    share: float,
    reason: str = "",
    actor: str | None = None,
    ledger: Ledger | None = None,
) -> ShadowStatus:
    """Start the candidate's server (or reuse one with its serving key) and mirror `share`
    of `env`'s requests to it; a `shadow` ledger event records it."""
    if not 0 < share <= 1:
        raise ShadowError(f"--share must be in (0, 1], got {share:g}")
    cfg = env_config(settings, env)
    keep_prompts = bool(environment_policy(settings, env, cfg).policy["shadow_keep_prompts"])
    led = ledger or open_ledger(settings)
    led.verified()
    rid = resolve_release(settings, release_ref, ledger=led).release_id
    info = load_release(settings, rid, ledger=led)
    failed = shadow_admission(settings, info, env=env, ledger=led)
    if failed:
        raise ShadowError(
            f"{info.short_id} may not be shadowed in {env}: "
            + "; ".join(f"{g.name}: {g.detail}" for g in failed),
            remedy="shadow only what promote would consider: register it, list the "
            "environment in its manifest, promote it where it must go first, approve it",
        )
    spec = release_spec(settings, info, ledger=led)
    live = led.live_at(env)
    with locked_state(settings.state_dir, env) as handle:
        target = target_for(settings, env, cfg, handle)
        target.reconcile()
        st = handle.state
        if st.gateway is None or not st.routed_release_ids():
            raise ShadowError(f"nothing serves {env}: there is no traffic to mirror")
        if rid in st.routed_release_ids():
            raise ShadowError(f"{info.short_id} already takes traffic in {env}")
        rec = st.server_serving(spec.serving_key)
        reused = rec is not None and target.health(target.upstream_of(rec))
        if rec is not None and reused:
            up = target.upstream_of(rec)
        else:
            up = _start_server(target, handle, spec, "the candidate's server")
        baseline = None
        method = baseline_method(cfg.policy(), info.lm.manifest.promotion.canary)
        if (
            method == "fresh"
            and live is not None
            and live.to_release is not None
            and isinstance(target, LocalTarget)
            and all(r.base_url != up.base_url for r in st.routes)
        ):
            try:
                baseline = _start_baseline(settings, target, handle, live.to_release, led)
            except ShadowError:
                if not reused:  # nothing is left running for a shadow that did not start
                    target.stop(up, grace_s=settings.server_stop_grace_s)
                    st.servers[:] = [s for s in st.servers if s.base_url != up.base_url]
                    handle.save()
                raise
        mirror = Mirror(
            route=up.route(spec),
            share=share,
            max_in_flight=cfg.shadow_max_in_flight,
            keep_prompts=keep_prompts,
            baseline=baseline,
        )
        try:
            target_client = GatewayClient(st.gateway.url, admin_token=st.gateway.admin_token)
            with target_client as c:
                c.set_routes(RouteTable(routes=list(st.routes), mirror=mirror))
        except GatewayError as exc:
            raise ShadowError(f"the gateway refused the mirror: {exc}") from exc
        st.mirror = mirror  # a restarted gateway mirrors again (`ensure_router`)
        prune_pairs(settings, env, st)
        handle.save()
    status = ShadowStatus(
        env=env,
        release_id=rid,
        stable_release_id=live.to_release if live else None,
        share=share,
        base_url=up.base_url,
        started_at=time.time(),
        reused_server=reused,
        baseline_url=baseline.base_url if baseline is not None else None,
    )
    _dir(settings).mkdir(parents=True, exist_ok=True)
    write_atomic(_dir(settings) / f"{env}.json", status.model_dump_json(indent=2).encode())
    led.append(
        Event(
            type=EventType.SHADOW,
            environment=env,
            from_release=status.stable_release_id,
            to_release=rid,
            reason=reason or f"mirror {share:.0%} of {env}'s requests to {info.short_id}",
            evidence={
                "action": "start",
                "share": share,
                "server": up.base_url,
                "judged_against": "fresh baseline" if baseline is not None else "live server",
            },
            live=False,
            actor=actor,
        )
    )
    return status


def prune_pairs(settings: Settings, env: str, state: EnvState) -> list[Path]:
    """Delete `env`'s stored answer pairs last written more than the environment's
    `mirror_pairs_keep_days` ago, except the release mirrored now; the files deleted."""
    cfg = env_config(settings, env)
    mirrored = [state.mirror.route.release_id] if state.mirror is not None else []
    return prune(
        store_dir(settings.state_dir, env),
        keep_s=cfg.mirror_pairs_keep_days * 86400,
        protect=mirrored,
    )


def _start_baseline(
    settings: Settings, target: LocalTarget, handle: Any, stable_id: str, led: Ledger
) -> Route:
    """Start a fresh server of the stable release for the shadow to be judged against
    (`baseline: fresh` in the candidate's canary policy, as its canary steps are): it gets
    the same copies at the same moment under its own label, and is stopped with the shadow."""
    base = release_spec(settings, load_release(settings, stable_id, ledger=led), ledger=led)
    up = _start_server(target, handle, base, "the fresh baseline server")
    return up.route(base).model_copy(update={"release_id": baseline_label(stable_id)})


def _start_server(target: Any, handle: Any, spec: ReleaseSpec, what: str) -> Upstream:
    """Start a server for the shadow and record it (role `shadow`: `shadow stop` ends it)."""
    try:
        up: Upstream = target.start(spec)
    except ReleaseStartError as exc:
        raise ShadowError(f"{what} did not start: {exc.message}") from exc
    rec = target.record(up)
    if rec is not None:
        rec.role = "shadow"
    handle.save()
    return up


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


def compare_shadow(
    settings: Settings,
    *,
    env: str,
    window_s: float = 30.0,
    max_window_s: float | None = None,
    checks: list[CanaryCheck] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    ledger: Ledger | None = None,
) -> ShadowComparison:
    """Judge the shadow candidate against stable over the next `window_s` seconds (the
    candidate manifest's canary checks, else the defaults) and keep the comparison.

    With `max_window_s` the window grows, `window_s` at a time up to `max_window_s`, while
    the comparison lacks the samples it needs (fewer answer pairs than the policy's
    `shadow_min_pairs`, or a required check still waiting for samples): a host that serves
    fewer requests a second needs longer for the same evidence, and the verdict should
    rest on the samples, not on the host's speed."""
    status = read_shadow(settings, env)
    if status is None:
        raise ShadowError(f"no shadow runs in {env}")
    state = read_state(settings.state_dir, env)
    if state.gateway is None:
        raise ShadowError(f"{env} has no gateway running")
    live = [r for r in state.routes if r.weight > 0]
    if not live:
        raise ShadowError(f"nothing serves {env}")
    stable = max(live, key=lambda r: r.weight)
    cfg = env_config(settings, env)
    applied = environment_policy(settings, env, cfg)
    pol = applied.policy
    min_agreement = float(pol["shadow_min_agreement"])
    min_pairs = int(pol["shadow_min_pairs"])
    led = ledger or open_ledger(settings)
    policy = load_release(settings, status.release_id, ledger=led).lm.manifest.promotion.canary
    if checks is None:
        checks = list(policy.checks) if policy else default_checks()
    # Judged as the canary would be: within the environment's ceilings.
    checks, clamps = checks_within(checks, cfg)
    clamped = clamp_note(env, clamps) if clamps else ""
    fields = Canary.model_fields
    warmup = policy.warmup_requests if policy else int(fields["warmup_requests"].default)
    settle = policy.settle_s if policy else float(fields["settle_s"].default)
    shared = stable.base_url == status.base_url
    candidate = state.mirror.route if state.mirror is not None else None
    base = state.mirror.baseline if state.mirror is not None else None
    # With a fresh baseline the candidate is compared with it (both fresh, both given the
    # same copies at the same moment), else with the live server.
    judged = base or stable
    gw_url = state.gateway.url
    # Judged as a canary is: the same priority and placement for both servers, the
    # candidate's first requests (a fresh server's) and the first seconds not in the window.
    held = []
    if candidate is not None and not shared:
        placed = judged.model_copy(update={"release_id": stable.release_id})
        held = even_out(
            settings,
            ShiftContext(
                env=env,
                gateway=state.gateway,
                canary=candidate,
                stable=[placed],
                previous_release_id=None,
            ),
        )
    try:
        with http_client(trust_env=False) as http, _client(settings, env) as c:
            if candidate is not None and not shared and warmup > 0:
                warm_up_server(http, candidate, warmup)
                if base is not None:  # warmed alike: both start from the same state
                    warm_up_server(http, base, warmup)
            if settle > 0:
                sleep(settle)
            s0 = c.state()

            def snap() -> Scrape:
                return scrape_pair(
                    http,
                    gw_url,
                    None if shared else status.base_url,
                    None if shared else judged.base_url,
                    timeout_s=settings.scrape_timeout_s,
                    unscraped=SHARED_SERVER,
                )

            before = snap()
            limit_s = max(window_s, max_window_s or window_s)
            stored = store_dir(settings.state_dir, env)
            waited = 0.0
            while True:
                step = min(window_s, limit_s - waited)
                sleep(step)
                waited += step
                after = snap()
                s1 = c.state()
                pairs = _window_pairs(c, status.release_id, s0, s1, stored=stored)
                cw, sw = pair_windows(env, status.release_id, judged.release_id, before, after)
                j = judge_step(checks, cw, sw)
                agreement = answer_agreement(
                    [answer_pair(p) for p in pairs if p.stable_release_id == stable.release_id],
                    min_agreement=min_agreement,
                    min_pairs=min_pairs,
                )
                short = agreement.pairs < min_pairs or any(
                    x.required and x.verdict == "wait" for x in j.checks
                )
                if not short or waited >= limit_s - 1e-9:
                    break
            window_s = waited
    finally:
        release(held)
    breached = [x for x in j.checks if x.verdict == "breach"]
    undecided = [x for x in j.checks if x.required and x.verdict != "pass"]
    verdict: ShadowVerdict = "breach" if breached else "insufficient" if undecided else "pass"
    reason = "; ".join(f"{x.metric}: {x.reason}" for x in (breached or undecided or j.checks))
    unjudged = [x for x in j.checks if x.verdict in ("wait", "not_measured") and x not in undecided]
    if (breached or undecided) and unjudged:
        reason += "; also not judged: " + "; ".join(x.brief() for x in unjudged)
    if agreement.verdict != "pass":
        verdict = "breach" if "breach" in (verdict, agreement.verdict) else "insufficient"
    reason = "; ".join(x for x in (f"answers: {agreement.reason}", reason, clamped) if x)
    cmp = ShadowComparison(
        env=env,
        release_id=status.release_id,
        stable_release_id=stable.release_id,
        verdict=verdict,
        window_s=window_s,
        at=time.time(),
        judgement=j,
        mirrored=s1.mirrored - s0.mirrored if s1.mirror == s0.mirror else s1.mirrored,
        dropped=s1.mirror_dropped - s0.mirror_dropped
        if s1.mirror == s0.mirror
        else s1.mirror_dropped,
        reason=reason[:2000],
        agreement=agreement,
        judged_against="fresh baseline" if base is not None else "live server",
        clamped=clamped,
    )
    rec = led.append(
        Event(
            type=EventType.SHADOW,
            environment=env,
            from_release=stable.release_id,
            to_release=status.release_id,
            reason=f"shadow comparison: {verdict} over {window_s:g} s",
            evidence={
                "action": "compare",
                "verdict": verdict,
                "stable_release_id": stable.release_id,
                "judged_against": cmp.judged_against,
                "window_s": window_s,
                "mirrored": cmp.mirrored,
                "dropped": cmp.dropped,
                "checks": [
                    {
                        "metric": x.metric,
                        "verdict": x.verdict,
                        "candidate": x.canary,
                        "stable": x.stable,
                        "limit": x.limit,
                    }
                    for x in j.checks
                ],
                "detail": reason[:1000],
                "agreement": agreement.evidence(),
                **({"clamped": clamped} if clamped else {}),
                # What the judge took, for `releasekit audit replay`.
                "judge": judged_inputs(checks, cw, sw),
                "policy": {"source": applied.evidence()["source"]},
            },
            live=False,
        )
    )
    stem = f"{env}-{status.release_id[:16]}.comparison"
    page = _dir(settings) / f"{stem}.html"
    cmp = cmp.model_copy(update={"seq": rec.seq, "page": str(page)})
    write_atomic(_dir(settings) / f"{stem}.json", cmp.model_dump_json(indent=2).encode())
    write_shadow_page(cmp, page)  # both are copies; the ledger decides
    return cmp


def _window_pairs(
    c: GatewayClient,
    candidate: str,
    s0: GatewayState,
    s1: GatewayState,
    *,
    stored: Path | None = None,
) -> list[MirrorPair]:
    """The answer pairs of the candidate recorded between two gateway states (all that are
    held when the mirror was replaced in between). Where the gateway's memory no longer
    holds the whole window (more pairs than its ring, or a restart in between) and its disk
    copy is in `stored` (a local gateway's), the window is read from the disk copy."""
    same = s1.mirror == s0.mirror == candidate and s1.mirror_pairs >= s0.mirror_pairs
    since = s0.mirror_pairs if same else 0
    try:
        got = c.mirror_pairs(since)
    except GatewayError as exc:
        raise ShadowError(f"the gateway did not answer its answer pairs: {exc}") from exc
    if got.release_id != candidate:
        return []
    held = [p for p in got.pairs if p.seq <= s1.mirror_pairs]
    first = held[0].seq if held else s1.mirror_pairs + 1
    if same and first > since + 1 and stored is not None:
        on_disk = read_pairs(stored, candidate, since=since, until=s1.mirror_pairs)
        if len(on_disk) > len(held):
            return on_disk
    return held


def stop_shadow(
    settings: Settings,
    *,
    env: str,
    reason: str = "",
    actor: str | None = None,
    ledger: Ledger | None = None,
) -> ShadowStatus:
    """Remove the mirror and stop the candidate's shadow server (the comparison stays)."""
    status = read_shadow(settings, env)
    if status is None:
        raise ShadowError(f"no shadow runs in {env}")
    cfg = env_config(settings, env)
    led = ledger or open_ledger(settings)
    with locked_state(settings.state_dir, env) as handle:
        target = target_for(settings, env, cfg, handle)
        st = handle.state
        if st.gateway is not None:
            gw = st.gateway
            with (
                contextlib.suppress(GatewayError),
                GatewayClient(gw.url, admin_token=gw.admin_token) as c,
            ):
                c.set_routes(RouteTable(routes=list(st.routes)))
        st.mirror = None
        prune_pairs(settings, env, st)
        for s in list(st.servers):
            if s.role == "shadow" and (
                s.release_id == status.release_id or s.base_url == status.baseline_url
            ):
                target.stop(target.upstream_of(s), grace_s=settings.server_stop_grace_s)
                if s in st.servers:  # the target forgets what it stopped
                    st.servers.remove(s)
        handle.save()
    with contextlib.suppress(FileNotFoundError):
        (_dir(settings) / f"{env}.json").unlink()
    led.append(
        Event(
            type=EventType.SHADOW,
            environment=env,
            from_release=status.stable_release_id,
            to_release=status.release_id,
            reason=reason or "shadow stopped",
            evidence={"action": "stop"},
            live=False,
            actor=actor,
        )
    )
    return status


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

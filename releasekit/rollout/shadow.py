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

Where each part lives (all re-exported here): the status, the comparison and the error in
`rollout.shadow_records`, `compare_shadow` in `rollout.shadow_compare`, the admission checks
and the "shadow comparison" gate in `rollout.shadow_gates`. This module starts and stops
the shadow.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from releasekit._support.files import write_atomic
from releasekit.config import Settings
from releasekit.deploy.gateway import (
    GatewayError,
    Mirror,
    Route,
    RouteTable,
    mb_bytes,
    prune,
    store_dir,
    store_problem,
)
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.local import LocalTarget
from releasekit.deploy.state import EnvState, locked_state
from releasekit.deploy.target import ReleaseSpec, ReleaseStartError, Upstream
from releasekit.errors import AdapterLoadError
from releasekit.promote.context import load_release, release_spec
from releasekit.promote.deploy import env_config, target_for
from releasekit.promote.policy import environment_policy
from releasekit.releases.resolve import resolve_release
from releasekit.rollout.baseline import baseline_method
from releasekit.rollout.canary import baseline_label
from releasekit.rollout.shadow_compare import compare_shadow
from releasekit.rollout.shadow_gates import shadow_admission, shadow_gate
from releasekit.rollout.shadow_records import (
    ShadowComparison,
    ShadowError,
    ShadowStatus,
    ShadowVerdict,
    read_comparison,
    read_shadow,
    shadow_dir,
)
from releasekit.stores.ledger import Event, EventType, Ledger, open_ledger


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
        _check_pair_store(settings, env, st)
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
    shadow_dir(settings).mkdir(parents=True, exist_ok=True)
    write_atomic(shadow_dir(settings) / f"{env}.json", status.model_dump_json(indent=2).encode())
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


def _check_pair_store(settings: Settings, env: str, state: EnvState) -> None:
    """Refuse a shadow whose answer pairs could not be kept: the environment's pairs folder
    cannot be written, or holds `mirror_pairs_max_mb` already once aged out."""
    cfg = env_config(settings, env)
    prune_pairs(settings, env, state)
    problem = store_problem(
        store_dir(settings.state_dir, env), max_bytes=mb_bytes(cfg.mirror_pairs_max_mb)
    )
    if problem is not None:
        raise ShadowError(
            f"no shadow in {env}: {problem}",
            remedy="free the folder (or make it writable), or raise mirror_pairs_max_mb",
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
    except (ReleaseStartError, AdapterLoadError) as exc:
        raise ShadowError(f"{what} did not start: {exc.message}") from exc
    rec = target.record(up)
    if rec is not None:
        rec.role = "shadow"
    handle.save()
    return up


def stop_shadow(
    settings: Settings,
    *,
    env: str,
    reason: str = "",
    actor: str | None = None,
    ledger: Ledger | None = None,
) -> ShadowStatus:
    """Remove the shadow's mirror and stop the candidate's shadow server and its fresh
    baseline (the comparison stays). After a promotion that took the shadow's servers (the
    candidate now live, its baseline stopped with the canary), it only records the end."""
    status = read_shadow(settings, env)
    if status is None:
        raise ShadowError(f"no shadow runs in {env}")
    cfg = env_config(settings, env)
    led = ledger or open_ledger(settings)
    with locked_state(settings.state_dir, env) as handle:
        target = target_for(settings, env, cfg, handle)
        st = handle.state
        # Only the shadow's own mirror ends here: a promotion since has set its table (and
        # maybe its after-promotion mirror), which stays.
        ours = st.mirror is not None and (
            st.mirror.purpose == "shadow" and st.mirror.route.release_id == status.release_id
        )
        if st.gateway is not None and ours:
            gw = st.gateway
            with (
                contextlib.suppress(GatewayError),
                GatewayClient(gw.url, admin_token=gw.admin_token) as c,
            ):
                c.set_routes(RouteTable(routes=list(st.routes)))
        if ours:
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
        (shadow_dir(settings) / f"{env}.json").unlink()
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


__all__ = [
    "ShadowComparison",
    "ShadowError",
    "ShadowStatus",
    "ShadowVerdict",
    "compare_shadow",
    "prune_pairs",
    "read_comparison",
    "read_shadow",
    "shadow_admission",
    "shadow_gate",
    "start_shadow",
    "stop_shadow",
]

"""What a watch of one environment judges: the live release (the ledger), its watch rules under
the environment's floor and its load profile's SLO rules (its manifest), its own load test as
the baseline of relative rules (its bench.json), and the /metrics URLs of its vLLM server and
the environment's gateway (the deploy state).

Errors (all `releasekit.errors.ReleasekitError`):
    WatchSetupError   the environment cannot be watched (nothing live, no manifest, no server)
"""

from __future__ import annotations

from pydantic import BaseModel, Field, ValidationError

from releasekit.config import Settings
from releasekit.deploy.state import DeployStateError, read_state
from releasekit.errors import ReleasekitError
from releasekit.promote.context import ReleaseInfo, load_release
from releasekit.promote.deploy import env_config
from releasekit.promote.policy import environment_policy, read_policy
from releasekit.releases.queries import status
from releasekit.spec.loadprofile import SLO, load_profile
from releasekit.stores.evidence import BenchPoint, BenchSummary, Percentiles
from releasekit.stores.ledger import Ledger
from releasekit.stores.results import ReleasePaths
from releasekit.stores.verified import SignedEvidence
from releasekit.watch.rules import (
    Baseline,
    BaselinePoint,
    Rule,
    from_manifest,
    rules_from_slo,
    with_floor,
)
from releasekit.watch.watcher import WatchTarget


class WatchSetupError(ReleasekitError):
    """Raised when an environment cannot be watched: nothing is live in it (ledger), the live
    release's manifest or load profile cannot be read, or the deploy state names no running
    server for it (nothing to scrape)."""

    remedy = (
        "promote a release to the environment (`releasekit promote REL --to ENV`) and check "
        "`releasekit deploy-status`"
    )


class WatchPlan(BaseModel):
    """What a watch of one environment judges: the live release, its rules (manifest watch
    rules, then load-profile SLO rules), the benchmark baseline, and where to scrape."""

    env: str
    release_id: str
    release_name: str | None = None
    rules: list[Rule]
    baseline: Baseline | None = None
    slo: SLO | None = None
    target: WatchTarget
    notes: list[str] = Field(default_factory=list, description="what is missing, in words")


def live_release_id(settings: Settings, env: str, *, ledger: Ledger) -> str:
    """The release live in `env` by the ledger (`releasekit status`); WatchSetupError if
    nothing is."""
    for s in status(settings, ledger=ledger).environments:
        if s.environment == env and s.release_id:
            return s.release_id
    raise WatchSetupError(f"nothing is live in {env}: there is nothing to watch")


def baseline_from_bench(bench: BenchSummary, *, release_id: str | None = None) -> Baseline | None:
    """The relative rules' baseline from a load test: one point per load level, at its
    completed request rate, with the window figure names (ttft_p95_s, e2e_p95_s, itl_p50_s,
    ..., error_rate, timeout_rate). Only points that passed the load test's cross-check
    count (an untrusted point measured the client, not the release). None when no point
    is left."""
    trusted = [b for b in bench.points if _passed_cross_check(b)]
    points = [p for p in (_baseline_point(b) for b in trusted) if p is not None]
    if not points:
        return None
    return Baseline(release=release_id or bench.release_id, points=points)


def _passed_cross_check(p: BenchPoint) -> bool:
    # Results written before `trusted` was recorded: any flag made the point untrusted.
    return p.trusted if p.trusted is not None else not p.flags


def _baseline_point(p: BenchPoint) -> BaselinePoint | None:
    rate = p.request_throughput
    if rate is None or rate <= 0:
        return None
    figures: dict[str, float] = {}
    for short, pct in (("ttft", p.ttft), ("itl", p.itl), ("e2e", p.e2e)):
        figures |= _percentile_figures(short, pct)
    n = p.n or 0
    if n > 0:
        if p.errors is not None:
            figures["error_rate"] = p.errors / n
        if p.timeouts is not None:
            figures["timeout_rate"] = p.timeouts / n
    if p.server_generation_tokens_per_s is not None:
        figures["generation_tokens_per_s"] = p.server_generation_tokens_per_s
    return BaselinePoint(request_rate=rate, figures=figures)


def _percentile_figures(short: str, pct: Percentiles) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in ("p50", "p90", "p95", "p99", "mean"):
        value = getattr(pct, key)
        if value is not None:
            out[f"{short}_{key}_s"] = float(value)
    return out


def read_baseline(
    settings: Settings, release_id: str, evidence: SignedEvidence | None = None
) -> Baseline | None:
    """The release's own benchmark (results/<id>/bench/bench.json, as its register event
    signed it: `evidence` from `load_release`) as a Baseline, or None when it has none, it
    is unreadable, or it is not the one signed."""
    path = ReleasePaths.of(settings, release_id).bench
    if evidence is None or evidence.problems_for("bench") or not path.is_file():
        return None
    try:
        bench = BenchSummary.model_validate_json(evidence.read_bytes("bench"))
    except (ReleasekitError, ValidationError, ValueError):
        return None
    return baseline_from_bench(bench, release_id=release_id)


def metrics_urls(settings: Settings, env: str, release_id: str) -> tuple[str, str | None]:
    """(vLLM /metrics URL, gateway /metrics URL) of `release_id` in `env`, from the deploy
    state: the server the gateway routes the release to (else any recorded for it), and the
    environment's gateway. WatchSetupError when no server is recorded."""
    try:
        state = read_state(settings.state_dir, env)
    except DeployStateError as exc:
        raise WatchSetupError(exc.message) from exc
    base: str | None = None
    for route in state.routes:
        if route.release_id == release_id and route.weight > 0:
            base = route.base_url
            break
    if base is None:
        rec = state.server_for(release_id)
        base = rec.base_url if rec else None
    if base is None:
        raise WatchSetupError(
            f"the deploy state of {env} names no server for {release_id[:12]}",
            remedy="check `releasekit deploy-status`; promote or roll back to start one",
        )
    rec = state.server_for(release_id)
    vllm = rec.metrics_url if rec is not None and rec.app else _join(base, "metrics")
    gateway: str | None = None
    if state.gateway is not None:
        gateway = state.gateway.url
    else:
        cfg = settings.environments.get(env)
        gateway = cfg.url if cfg is not None else None
    return vllm, (_join(gateway, "metrics") if gateway else None)


def _join(base: str, path: str) -> str:
    return base.rstrip("/") + "/" + path


def plan_watch(
    settings: Settings,
    env: str,
    *,
    ledger: Ledger,
    release_id: str | None = None,
    include_slo: bool = True,
    extra_rules: list[Rule] | None = None,
    vllm_metrics_url: str | None = None,
    gateway_metrics_url: str | None = None,
) -> WatchPlan:
    """Everything a watch of `env` needs, for its live release (or `release_id`): rules
    from the manifest's `watch` list and (with `include_slo`) the load profile's SLOs, over
    windows as long and as many as the manifest's longest rule; the benchmark baseline; the
    /metrics URLs (given ones win over the deploy state). WatchSetupError if any is missing."""
    rid = release_id or live_release_id(settings, env, ledger=ledger)
    notes: list[str] = []
    try:
        info = load_release(settings, rid, ledger=ledger)
    except ReleasekitError as exc:
        raise WatchSetupError(
            f"cannot read the manifest of {rid[:12]}, live in {env}: {exc.message}",
            remedy=exc.remedy or WatchSetupError.remedy,
        ) from exc
    manifest = info.lm.manifest
    rules, slo, more = release_rules(info, watch_floor(settings, env), env, include_slo=include_slo)
    notes += more
    rules += extra_rules or []
    rules = _unique(rules)
    if not rules:
        raise WatchSetupError(
            f"{manifest.name} ({rid[:12]}) has no watch rules and no SLOs",
            remedy="add a `watch:` list to the manifest",
        )
    baseline = read_baseline(settings, rid, info.evidence)
    if baseline is None:
        signed = info.evidence.problems_for("bench") if info.evidence else []
        why = signed[0] if signed else "no bench.json"
        notes.append(f"{why}: relative rules judge 'no data'")
    if vllm_metrics_url is None:
        vllm_metrics_url, state_gw = metrics_urls(settings, env, rid)
        gateway_metrics_url = gateway_metrics_url or state_gw
    target = WatchTarget(
        env=env,
        release=rid,
        vllm_metrics_url=vllm_metrics_url,
        gateway_metrics_url=gateway_metrics_url,
    )
    return WatchPlan(
        env=env,
        release_id=rid,
        release_name=manifest.name,
        rules=rules,
        baseline=baseline,
        slo=slo,
        target=target,
        notes=notes,
    )


def release_rules(
    info: ReleaseInfo, floor: list[Rule], env: str, *, include_slo: bool = True
) -> tuple[list[Rule], SLO | None, list[str]]:
    """A release's watch rules in `env`: the manifest's `watch` list under the environment's
    `floor`, then (with `include_slo`) its load profile's SLO rules; (rules, SLO, notes).
    `plan_watch` and `releasekit audit replay` both derive them here."""
    manifest = info.lm.manifest
    rules = [from_manifest(r) for r in manifest.watch]
    # The environment's floor: the release's own rules only tighten it.
    rules, notes = with_floor(rules, floor, env=env)
    slo: SLO | None = None
    if include_slo:
        try:
            slo = load_profile(info.lm.resolve(manifest.load.profile)).slo
        except ReleasekitError as exc:
            notes.append(f"load profile unreadable, SLO rules left out: {exc.message}")
    if slo is not None:
        window = max((r.window_s for r in rules), default=60.0)
        sustain = max((r.sustain for r in rules), default=3)
        rules += rules_from_slo(slo, window_s=window, sustain=sustain)
    return _unique(rules), slo, notes


def watch_floor(settings: Settings, env: str) -> list[Rule]:
    """`env`'s floor under every release's watch rules (`watch_floor`, committed policy);
    PolicyError when this command's settings change it from the committed policy."""
    cfg = env_config(settings, env)
    if "watch_floor" in read_policy(settings, env, cfg).differs:
        environment_policy(settings, env, cfg)  # raises, naming the fields
    return [from_manifest(r) for r in cfg.watch_floor]


def _unique(rules: list[Rule]) -> list[Rule]:
    # An SLO rule may mirror a manifest rule of the same name: the manifest's wins.
    seen: set[str] = set()
    out = []
    for r in rules:
        if r.name not in seen:
            seen.add(r.name)
            out.append(r)
    return out

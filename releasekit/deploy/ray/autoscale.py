"""Autoscaling a release's replicas on the `ray` target: the environment's policy
(`[environments.NAME.ray] autoscaling`, releasekit.config.RayAutoscaling) applied to one
release gives an `AutoscalePlan`, which becomes Ray Serve's `autoscaling_config`.

With `target = "knee"` the per-replica target of requests in flight is the release's own
knee (requests in flight on one server where its SLOs still held, from its verified load
test: `ReleaseSpec.knee`) times (1 - `knee_headroom`):

    autoscaling 1-2 replicas, target 24 in flight per replica = knee 32 x (1 - 0.25)

A release without usable knee evidence is refused (NoKneeEvidenceError) before anything is
deployed. `target_queue_depth` sets the target by hand instead. The range and the delays
are the environment's, from releasekit.toml as committed; nothing of it comes from the
release. Pure: no Ray.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, computed_field

from releasekit.config import RayAutoscaling
from releasekit.deploy.target import DeployError, KneeEvidence, ReleaseSpec


class NoKneeEvidenceError(DeployError):
    """Raised when an environment derives its autoscaling target from the knee and the
    release has no usable knee evidence (no load test, one made for another release or
    load profile, or a sweep where no load met the SLOs)."""

    remedy = (
        "run `releasekit bench MANIFEST` for this release on a host with the replica's cores "
        "(its sweep needs a load that meets the SLOs), or set autoscaling.target_queue_depth "
        "by hand in releasekit.toml"
    )


class AutoscalePlan(BaseModel):
    """How a release's replicas scale in an environment, with where the target comes from."""

    environment: str
    release_id: str
    min_replicas: int
    max_replicas: int
    target_in_flight: float = Field(description="requests in flight per replica Ray aims at")
    source: Literal["knee", "by hand", "fixed at max"] = Field(
        description="where the target comes from; `fixed at max`: a release started without "
        "a promotion (a rollback) whose knee evidence is gone runs max_replicas, unscaled"
    )
    why_fixed: str | None = Field(None, description="`fixed at max`: why there is no knee")
    knee_in_flight: float | None = Field(None, description="requests in flight at the knee")
    knee_headroom: float | None = Field(None, description="share of the knee kept spare")
    knee_source: str | None = Field(None, description="the bench result the knee is from")
    knee_scaled: str | None = Field(
        None, description="knee_cores = scale: the measured knee and cores it was scaled from"
    )
    upscale_delay_s: float
    downscale_delay_s: float
    look_back_period_s: float
    metrics_interval_s: float

    @computed_field  # type: ignore[prop-decorator]
    @property
    def text(self) -> str:
        """The plan in one line: range, target and how the target was made."""
        span = (
            f"{self.min_replicas} replica"
            if self.min_replicas == self.max_replicas == 1
            else f"{self.min_replicas}-{self.max_replicas} replicas"
        )
        head = f"autoscaling {span}, target {self.target_in_flight:g} in flight per replica"
        if self.source == "fixed at max":
            return (
                f"autoscaling off for this release: {self.max_replicas} replicas, the "
                f"environment's max_replicas (no usable knee evidence: {self.why_fixed})"
            )
        if self.source == "knee":
            head += f" = knee {self.knee_in_flight:g} x (1 - {self.knee_headroom:g})"
            if self.knee_scaled:
                head += f" ({self.knee_scaled})"
        else:
            head += " (target_queue_depth, set by hand)"
        return (
            f"{head}; up after {self.upscale_delay_s:g} s, down after {self.downscale_delay_s:g} s"
        )


def autoscale_plan(
    env: str,
    auto: RayAutoscaling,
    spec: ReleaseSpec,
    *,
    fixed_without_knee: bool = False,
    replica_cpus: float | None = None,
) -> AutoscalePlan:
    """The autoscaling `auto` (an environment's policy) gives release `spec`.
    NoKneeEvidenceError when the target comes from the knee and `spec` has none (or one
    measured on another core count than `replica_cpus`, the CPUs a replica gets), unless
    `fixed_without_knee` (a start that is not a promotion: a rollback must always be able
    to bring the previous release back), when it runs max_replicas, unscaled."""
    return plan_for(
        env, auto, spec.release_id, spec.knee, spec.knee_problem,
        fixed_without_knee=fixed_without_knee, replica_cpus=replica_cpus,
    )  # fmt: skip


def knee_cores_problem(knee: KneeEvidence, replica_cpus: float | None) -> str | None:
    """Why a knee does not apply to replicas with `replica_cpus` CPUs (None: it does, or no
    replica size is known): requests in flight at the knee depend on the cores that served
    them, so a knee measured on 2 cores says nothing about a 1-CPU replica."""
    if replica_cpus is None:
        return None
    if knee.cores is None:
        return (
            f"{knee.source} records no host (measured before releasekit recorded where), so "
            f"its knee cannot be matched to a replica of {replica_cpus:g} CPU"
        )
    if float(knee.cores) != float(replica_cpus):
        return (
            f"its knee was measured on {knee.cores} core{'s' if knee.cores != 1 else ''} "
            f"({knee.host or knee.source}), and a replica here gets {replica_cpus:g} CPU: a "
            "knee does not carry across core counts (bench it with the replica's cores, or "
            "set cpus_per_replica to the knee's)"
        )
    return None


def plan_for(
    env: str,
    auto: RayAutoscaling,
    release_id: str,
    knee: KneeEvidence | None,
    knee_problem: str | None = None,
    *,
    fixed_without_knee: bool = False,
    replica_cpus: float | None = None,
) -> AutoscalePlan:
    """`autoscale_plan` from a release's id and knee evidence (None, with why); a knee
    measured on another core count than `replica_cpus` counts as none."""
    common: dict[str, Any] = {
        "environment": env,
        "release_id": release_id,
        "min_replicas": auto.min_replicas,
        "max_replicas": auto.max_replicas,
        "upscale_delay_s": auto.upscale_delay_s,
        "downscale_delay_s": auto.downscale_delay_s,
        "look_back_period_s": auto.look_back_period_s,
        "metrics_interval_s": auto.metrics_interval_s,
    }
    if auto.target_queue_depth is not None:
        return AutoscalePlan(**common, target_in_flight=auto.target_queue_depth, source="by hand")
    headroom = auto.knee_headroom if auto.knee_headroom is not None else 0.0
    cores_bad = knee_cores_problem(knee, replica_cpus) if knee is not None else None
    scaled: str | None = None
    if (
        cores_bad is not None
        and knee is not None
        and knee.cores
        and replica_cpus
        and auto.knee_cores == "scale"
    ):
        # The committed policy asks for the knee in proportion to cores: stated in the plan.
        scaled = (
            f"scaled from knee {knee.in_flight:g} measured on {knee.cores} core"
            f"{'s' if knee.cores != 1 else ''} to {replica_cpus:g} CPU (knee_cores = scale)"
        )
        knee = knee.model_copy(
            update={"in_flight": round(knee.in_flight * replica_cpus / knee.cores, 3)}
        )
        cores_bad = None
    if cores_bad is not None:
        knee, knee_problem = None, cores_bad
    if knee is None or knee.in_flight <= 0:
        why = knee_problem or "its load test has no knee"
        if fixed_without_knee:
            common.update(min_replicas=auto.max_replicas)
            return AutoscalePlan(
                **common, target_in_flight=1.0, source="fixed at max", why_fixed=why
            )
        raise NoKneeEvidenceError(
            f"environment {env} scales replicas from the release's knee, and release "
            f"{release_id[:12]} has no usable knee evidence: {why}"
        )
    target = round(knee.in_flight * (1 - headroom), 3)
    if target <= 0:
        raise NoKneeEvidenceError(
            f"release {release_id[:12]}: knee {knee.in_flight:g} x (1 - {headroom:g}) "
            "leaves no requests in flight per replica"
        )
    return AutoscalePlan(
        **common,
        target_in_flight=target,
        source="knee",
        knee_in_flight=knee.in_flight,
        knee_headroom=headroom,
        knee_source=knee.source,
        knee_scaled=scaled,
    )


def serve_autoscaling_config(plan: AutoscalePlan, *, replicas: int) -> dict[str, Any]:
    """Ray Serve's `autoscaling_config` for `plan` (fields of Ray's AutoscalingConfig),
    starting at `replicas` kept within the range."""
    return {
        "min_replicas": plan.min_replicas,
        "initial_replicas": max(plan.min_replicas, min(replicas, plan.max_replicas)),
        "max_replicas": plan.max_replicas,
        "target_ongoing_requests": plan.target_in_flight,
        "upscale_delay_s": plan.upscale_delay_s,
        "downscale_delay_s": plan.downscale_delay_s,
        "look_back_period_s": plan.look_back_period_s,
        "metrics_interval_s": plan.metrics_interval_s,
    }

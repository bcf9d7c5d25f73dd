"""A capacity plan's units as replicas of the `ray` deploy target: one unit is one replica
(one vLLM engine), so the plan says how many replicas an environment's release needs, how
many Ray CPUs they reserve, the promote command that applies it, and the autoscaling range
it implies: the peak's units as `max_replicas`, the units the day's mean rate needs as
`min_replicas` (the plan has no trough figure; the trough is at most the mean)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from releasekit.capacity.errors import CapacityEvidenceError
from releasekit.capacity.plan_arithmetic import units_needed
from releasekit.capacity.plan_models import CapacityPlan
from releasekit.config import Settings
from releasekit.errors import ConfigError


class AutoscaleRange(BaseModel):
    """The autoscaling range a plan implies for an environment, beside the one it has."""

    min_replicas: int = Field(description="units for the day's mean rate (trough side)")
    max_replicas: int = Field(description="units for the peak (the plan's units)")
    mean_requests_per_s: float = Field(description="daily requests / 86,400 s")
    working: str
    configured: str | None = Field(None, description="the environment's range, if it autoscales")

    @property
    def text(self) -> str:
        """The range in one line, with the environment's own."""
        mine = f"; releasekit.toml: {self.configured}" if self.configured else ""
        return (
            f"autoscaling range {self.min_replicas}-{self.max_replicas} replicas "
            f"({self.working}){mine}"
        )


class ReplicaPlan(BaseModel):
    """The plan's units for one environment on the `ray` target."""

    environment: str
    replicas: int = Field(description="one replica per serving unit")
    cpus_per_replica: float
    cpus_total: float = Field(description="Ray CPUs the replicas reserve")
    configured_replicas: int = Field(description="the environment's count in releasekit.toml")
    promote_command: str
    autoscaling: AutoscaleRange
    warnings: list[str] = Field(default_factory=list)


def replica_cpus(settings: Settings, env: str) -> float:
    """The CPUs one replica of `env` gets; ConfigError unless `env` runs on the ray target."""
    cfg = settings.environments.get(env)
    if cfg is None or cfg.target != "ray" or cfg.ray is None:
        where = "not configured" if cfg is None else f"on target {cfg.target}"
        raise ConfigError(
            f"--env {env}: replicas are planned for a ray environment; {env} is {where}",
            remedy='name an environment with target = "ray" in releasekit.toml',
        )
    return cfg.ray.cpus_per_replica


def replica_plan(
    settings: Settings, env: str, plan: CapacityPlan, *, release: str | None = None
) -> ReplicaPlan:
    """The replicas `plan` asks of `env`; ConfigError unless `env` runs on the ray target.
    A plan from a load test must be for units with the replica's cores (`plan.unit.cores`,
    see plan_from_bench's `unit_cores`): CapacityEvidenceError otherwise."""
    cfg = settings.environments.get(env)
    if cfg is None or cfg.target != "ray" or cfg.ray is None:
        where = "not configured" if cfg is None else f"on target {cfg.target}"
        raise ConfigError(
            f"--env {env}: replicas are planned for a ray environment; {env} is {where}",
            remedy='name an environment with target = "ray" in releasekit.toml',
        )
    ray = cfg.ray
    u = plan.unit
    if u.source == "load test" and (u.cores is None or float(u.cores) != ray.cpus_per_replica):
        measured = u.measured_on.label if u.measured_on else "a host bench.json does not record"
        raise CapacityEvidenceError(
            f"--env {env}: the plan's per-unit rate was measured on {measured}, and a replica "
            f"there gets {ray.cpus_per_replica:g} CPU: a knee does not carry across core counts",
            remedy="plan with --env so the knee is checked against the replica's cores (and "
            "--scale-cores to scale it), bench with the replica's cores, or set "
            "cpus_per_replica to the knee's",
        )
    warnings = []
    if ray.autoscaling is not None and ray.autoscaling.max_replicas < plan.units:
        warnings.append(
            f"the environment autoscales up to {ray.autoscaling.max_replicas} replicas, fewer "
            f"than the plan's {plan.units}: raise autoscaling.max_replicas"
        )
    t = plan.traffic
    mean = t.daily_requests / 86_400.0
    per_unit = plan.unit.requests_per_s
    low = min(plan.units, units_needed(mean, per_unit, headroom=t.headroom, min_units=t.min_units))
    auto = ray.autoscaling
    rng = AutoscaleRange(
        min_replicas=low,
        max_replicas=plan.units,
        mean_requests_per_s=mean,
        working=f"mean {mean:.3g} req/s -> {low}, peak {plan.peak_requests_per_s:.3g} req/s "
        f"-> {plan.units}, at {per_unit:.3g} req/s per replica x headroom {t.headroom:g}",
        configured=f"{auto.min_replicas}-{auto.max_replicas}" if auto is not None else None,
    )
    return ReplicaPlan(
        environment=env,
        autoscaling=rng,
        replicas=plan.units,
        cpus_per_replica=ray.cpus_per_replica,
        cpus_total=plan.units * ray.cpus_per_replica,
        configured_replicas=ray.replicas,
        promote_command=(
            f"releasekit promote {release or 'RELEASE'} --to {env} --replicas {plan.units}"
        ),
        warnings=warnings,
    )


class PlannedReplicas(BaseModel):
    """A capacity plan with its units as one ray environment's replicas (`--env`)."""

    plan: CapacityPlan
    replicas: ReplicaPlan

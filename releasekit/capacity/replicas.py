"""A capacity plan's units as replicas of the `ray` deploy target: one unit is one replica
(one vLLM engine), so the plan says how many replicas an environment's release needs, how
many Ray CPUs they reserve, and the promote command that applies it."""

from __future__ import annotations

from pydantic import BaseModel, Field

from releasekit.capacity.plan_models import CapacityPlan
from releasekit.config import Settings
from releasekit.errors import ConfigError


class ReplicaPlan(BaseModel):
    """The plan's units for one environment on the `ray` target."""

    environment: str
    replicas: int = Field(description="one replica per serving unit")
    cpus_per_replica: float
    cpus_total: float = Field(description="Ray CPUs the replicas reserve")
    configured_replicas: int = Field(description="the environment's count in releasekit.toml")
    promote_command: str
    warnings: list[str] = Field(default_factory=list)


def replica_plan(
    settings: Settings, env: str, plan: CapacityPlan, *, release: str | None = None
) -> ReplicaPlan:
    """The replicas `plan` asks of `env`; ConfigError unless `env` runs on the ray target."""
    cfg = settings.environments.get(env)
    if cfg is None or cfg.target != "ray" or cfg.ray is None:
        where = "not configured" if cfg is None else f"on target {cfg.target}"
        raise ConfigError(
            f"--env {env}: replicas are planned for a ray environment; {env} is {where}",
            remedy='name an environment with target = "ray" in releasekit.toml',
        )
    ray = cfg.ray
    warnings = []
    if ray.autoscaling is not None and ray.autoscaling.max_replicas < plan.units:
        warnings.append(
            f"the environment autoscales up to {ray.autoscaling.max_replicas} replicas, fewer "
            f"than the plan's {plan.units}: raise autoscaling.max_replicas"
        )
    return ReplicaPlan(
        environment=env,
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

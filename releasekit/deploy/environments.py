"""An environment's settings by name (`env_config`) and the deploy target it names
(`target_for`)."""

from __future__ import annotations

from releasekit.config import EnvironmentConfig, Settings
from releasekit.config.lanes import parent_env
from releasekit.deploy.local import LocalTarget
from releasekit.deploy.state import StateHandle
from releasekit.errors import ConfigError


class EnvironmentNotConfiguredError(ConfigError):
    """Raised when a command names an environment that releasekit.toml does not define."""

    remedy = "add [environments.NAME] (port, target, policy) to releasekit.toml"


def env_config(settings: Settings, env: str) -> EnvironmentConfig:
    """The environment's settings (an adapter lane's are its environment's:
    `releasekit.config.lanes`); EnvironmentNotConfiguredError if releasekit.toml has none."""
    cfg = settings.environments.get(parent_env(env))
    if cfg is None:
        known = ", ".join(sorted(settings.environments)) or "none"
        raise EnvironmentNotConfiguredError(
            f"environment {env!r} is not configured in releasekit.toml (configured: {known})"
        )
    return cfg


def target_for(
    settings: Settings,
    env: str,
    cfg: EnvironmentConfig,
    handle: StateHandle,
    *,
    replicas: int | None = None,
) -> LocalTarget:
    """The deploy target an environment names (`target` in releasekit.toml): `local`, or
    `ray` (with `replicas` per release instead of the environment's count, when given)."""
    if cfg.target == "local":
        return LocalTarget(settings, env, cfg, handle)
    if cfg.target == "ray":
        from releasekit.deploy.ray.target import RayTarget

        return RayTarget(settings, env, cfg, handle, replicas=replicas)
    raise EnvironmentNotConfiguredError(f"environment {env!r}: unknown target {cfg.target!r}")

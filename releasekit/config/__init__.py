"""Typed, layered settings: flags > RELEASEKIT_* environment > releasekit.toml > defaults.

`Settings` and its sources live in `releasekit.config.settings`, an environment's settings
and policy (`EnvironmentConfig`, its ceilings, `WatchRule`) in
`releasekit.config.environments`, the `ray` target's in `releasekit.config.ray`; all are
re-exported here.
"""

from __future__ import annotations

from releasekit.config.environments import (
    DEFAULT_HIGHER_BETTER_TOLERANCE,
    DEFAULT_MAX_CANARY_CONFIDENCE,
    DEFAULT_MAX_CANARY_SLACK,
    DEFAULT_MAX_CANARY_SUSTAIN,
    DEFAULT_MAX_CANARY_TOLERANCE,
    DEFAULT_MAX_MARGIN,
    DEFAULT_MAX_PERF_SPREAD,
    DEFAULT_MAX_PERF_TOLERANCE,
    HIGHER_BETTER_PERF,
    MAX_HIGHER_BETTER_TOLERANCE,
    POLICY_FIELDS,
    EnvironmentConfig,
    SmokeConfig,
    WatchRule,
)
from releasekit.config.ray import RayAutoscaling, RayTargetConfig
from releasekit.config.settings import (
    CONFIG_FILE,
    Settings,
    TrustSettings,
    WebhookConfig,
    find_root,
    load_settings,
)

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_HIGHER_BETTER_TOLERANCE",
    "DEFAULT_MAX_CANARY_CONFIDENCE",
    "DEFAULT_MAX_CANARY_SLACK",
    "DEFAULT_MAX_CANARY_SUSTAIN",
    "DEFAULT_MAX_CANARY_TOLERANCE",
    "DEFAULT_MAX_MARGIN",
    "DEFAULT_MAX_PERF_SPREAD",
    "DEFAULT_MAX_PERF_TOLERANCE",
    "HIGHER_BETTER_PERF",
    "MAX_HIGHER_BETTER_TOLERANCE",
    "POLICY_FIELDS",
    "EnvironmentConfig",
    "RayAutoscaling",
    "RayTargetConfig",
    "Settings",
    "SmokeConfig",
    "TrustSettings",
    "WatchRule",
    "WebhookConfig",
    "find_root",
    "load_settings",
]

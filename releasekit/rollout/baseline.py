"""What a canary or a shadow is judged against: the environment's committed policy
(`comparison_baseline`) decides where it names a method; else the candidate's manifest
(`promotion.canary.baseline`); else the live servers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationError

from releasekit.errors import ConfigError
from releasekit.spec.manifest import Canary

Method = Literal["live", "fresh"]


class BaselinePolicyError(ConfigError):
    """The candidate's canary steps cannot run under the baseline the environment requires."""


def baseline_method(policy: dict[str, Any], canary: Canary | None) -> Method:
    """The method `policy` (an environment's policy fields) and the candidate's canary
    policy give: the environment's `comparison_baseline` when set, else the manifest's."""
    required = policy.get("comparison_baseline")
    if required in ("live", "fresh"):
        return required  # type: ignore[no-any-return]
    return canary.baseline if canary is not None else "live"


def canary_under_policy(policy: dict[str, Any], canary: Canary | None, env: str) -> Canary | None:
    """The candidate's canary steps with the baseline method `env`'s policy requires;
    BaselinePolicyError when its steps cannot run that way (a judged weight over 50 with a
    fresh baseline, which takes as much traffic as the canary)."""
    if canary is None:
        return None
    method = baseline_method(policy, canary)
    if method == canary.baseline:
        return canary
    try:
        return Canary.model_validate({**canary.model_dump(), "baseline": method})
    except ValidationError as exc:
        reason = "; ".join(
            str(e.get("msg", "")).removeprefix("Value error, ") for e in exc.errors()
        )
        raise BaselinePolicyError(
            f"{env} judges canaries against a {method} baseline (comparison_baseline in "
            f"releasekit.toml), and this release's canary steps cannot run so: {reason}",
            remedy="change the manifest's promotion.canary steps (a judged weight of at most "
            "50 with a fresh baseline)",
        ) from exc

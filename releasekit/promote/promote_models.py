"""What a promotion is asked (`PromoteRequest`), what it resolved (`PromoteTarget`), what it
did (`PromoteResult`, `PromoteStatus`), and `PromoteError`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit.config import EnvironmentConfig
from releasekit.deploy.ray.autoscale import AutoscalePlan
from releasekit.errors import ReleasekitError
from releasekit.promote.context import ReleaseInfo
from releasekit.promote.deploy_models import DeployOutcome
from releasekit.promote.gate_results import GateKind, GateReport
from releasekit.promote.policy import EnvironmentPolicy
from releasekit.releases.prompt_alias import PromptAliasResult
from releasekit.stores.ledger import LedgerRecord

PromoteStatus = Literal[
    "dry_run",
    "blocked",
    "deploy_failed",
    "canary_aborted",
    "promoted",
    "already_live",
    "redeployed",
]


class PromoteError(ReleasekitError):
    """Raised when a promotion cannot even be attempted: the environment is not one the
    release may go to, or --force came without a reason."""

    remedy = "read the message; `releasekit promote --help` lists the options"


class PromoteResult(BaseModel):
    """What a promotion did, with the gate report and the deploy's steps."""

    status: PromoteStatus
    environment: str
    release_id: str
    release_name: str
    live_release_id: str | None = None
    forced: bool = False
    overridden: list[str] = Field(default_factory=list, description="failed gates overridden")
    report: GateReport | None = None
    report_json: str | None = None
    report_html: str | None = None
    deploy: DeployOutcome | None = None
    record: LedgerRecord | None = None
    prompt_alias: PromptAliasResult | None = None
    warnings: list[str] = Field(default_factory=list)
    gateway_url: str | None = None
    canary: dict[str, Any] | None = Field(
        None, description="the canary steps as they ran (releasekit.rollout.canary.CanaryRun)"
    )
    canary_power: list[dict[str, Any]] | None = Field(
        None, description="each canary check's power at its min_samples (rollout.power)"
    )
    autoscaling: AutoscalePlan | None = Field(
        None, description="how the release's replicas scale there (a ray environment's policy)"
    )

    @property
    def ok(self) -> bool:
        """True when the release serves the environment (or a dry run passed its gates)."""
        if self.status == "dry_run":
            return bool(self.report and self.report.passed)
        return self.status in ("promoted", "already_live", "redeployed")


class PromoteRequest(BaseModel):
    """What a promotion is asked to do: which release, to which environment, why, by whom,
    and whether it is a dry run or forced over failed gates."""

    release_ref: str = Field(description="anything resolve_release accepts")
    env: str
    reason: str = ""
    dry_run: bool = False
    force: list[GateKind] = Field(
        default_factory=list,
        description="the kinds of gate an override may carry past (perf, quality, evidence, "
        "policy); each must be named, so a performance override never carries a quality "
        "failure",
    )
    actor: str | None = None
    approval_wait_s: float | None = Field(
        None, ge=0, description="wait this long for a missing approval (default: the env's)"
    )
    replicas: int | None = Field(
        None,
        ge=1,
        description="`ray` target: replicas of the release instead of the environment's "
        "count (e.g. the capacity plan's units)",
    )
    canary_steps: bool = Field(
        False,
        description="the release goes live through its manifest's canary steps (where the "
        "environment has `perf_by_canary`, its offline perf gates are then advisory)",
    )


@dataclass(frozen=True)
class PromoteTarget:
    """A resolved promotion: the candidate, the environment's settings and the release of
    record there."""

    info: ReleaseInfo
    cfg: EnvironmentConfig
    live_id: str | None
    base: PromoteResult
    policy: EnvironmentPolicy | None = None
    compare_id: str | None = None
    """The release the gates compare with when nothing is live in `live_id`'s place: an
    adapter lane's first release is judged against its environment's live base."""

"""What a deploy step reports (`DeployOutcome`, its steps, the after-promotion mirror) and
the traffic-shift hook it runs before the switch (`ShiftContext`, `ShiftResult`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit.deploy.gateway import Route
from releasekit.deploy.state import GatewayRecord
from releasekit.deploy.target import DeployError, SmokeResult, Upstream
from releasekit.stores.ledger import LedgerRecord

DeployStage = Literal["start", "adapters", "smoke", "canary", "switch", "gateway_smoke", "record"]


class ConcurrentChangeError(DeployError):
    """Raised when what is live in the environment changed while this command waited for
    the environment's deploy lock (another promote or rollback got there first)."""

    remedy = "look at `releasekit status` and run the command again if it still applies"


class DeployStep(BaseModel):
    """One step of a deploy, how long it took, and what it found."""

    step: str
    ok: bool
    seconds: float
    detail: str = ""


class AfterPromotionMirror(BaseModel):
    """The after-promotion comparison a deploy set up: `share` of the live requests copied
    to the previous release's warm server until `until` (unix time)."""

    previous_release_id: str
    base_url: str
    share: float
    window_s: float
    until: float


class DeployOutcome(BaseModel):
    """What a deploy did: where the environment's traffic goes now, and why if it failed."""

    environment: str
    release_id: str
    previous_release_id: str | None = None
    gateway_url: str | None = None
    ok: bool
    failed_stage: DeployStage | None = None
    failure: str | None = None
    reverted: bool = Field(False, description="traffic was switched back after a late failure")
    reused_server: bool = Field(False, description="no new vLLM: a running server serves it")
    reused_role: str | None = Field(
        None,
        description="what the reused server was: `live` (only prompts or adapters differ), "
        "`warm` (kept after an earlier release) or `shadow` (the release's own shadow server)",
    )
    switched: bool = False
    switch_s: float | None = Field(None, description="from the start of the step to the switch")
    smoke_preview: SmokeResult | None = None
    smoke_gateway: SmokeResult | None = None
    warm: list[str] = Field(default_factory=list, description="releases kept warm")
    stopped: list[str] = Field(default_factory=list, description="releases whose server stopped")
    drained: bool | None = None
    notes: list[str] = Field(default_factory=list)
    steps: list[DeployStep] = Field(default_factory=list)
    failure_event: LedgerRecord | None = None
    after_promotion: AfterPromotionMirror | None = Field(
        None, description="answers compared with the previous release's for a window"
    )
    serving: list[str] | None = Field(
        None,
        description="after a failure: the releases the environment's gateway still sends "
        "traffic to (empty: nothing serves it), read from the deploy state",
    )

    @property
    def still_serving(self) -> str:
        """After a failure, who keeps serving, in words: '0123abcd4567 keeps serving',
        'nothing serves staging'."""
        if self.serving is None:  # not read: the release of record before the deploy
            prev = self.previous_release_id
            return f"{prev[:12]} keeps serving" if prev else f"nothing serves {self.environment}"
        if not self.serving:
            return f"nothing serves {self.environment}"
        names = ", ".join(r[:12] for r in self.serving)
        return f"{names} {'keeps' if len(self.serving) == 1 else 'keep'} serving"


RecordFn = Callable[[str], Any]
"""Moves the record once traffic is on the new release; gets the gateway URL. Raising
reverts the switch."""


@dataclass(frozen=True)
class ShiftContext:
    """What a traffic shift before the switch (canary steps) works with: the environment's
    gateway, the candidate's route and the routes serving now (stable)."""

    env: str
    gateway: GatewayRecord
    canary: Route
    stable: list[Route]
    previous_release_id: str | None
    links: dict[str, str] = field(default_factory=dict)
    start_baseline: Callable[[], tuple[Route, Upstream]] | None = None
    """Starts a fresh server of the live release (not routed): its route and handle. Only
    where the target can run a second server of a release (local)."""
    stop_baseline: Callable[[], None] | None = None
    """Stops the server `start_baseline` started, or `kept_baseline` (call once nothing is
    routed to it)."""
    kept_baseline: tuple[Route, Upstream] | None = None
    """A fresh server of the live release already running beside the candidate's, started
    with it for the candidate's shadow: judged against instead of starting one."""


class ShiftResult(BaseModel):
    """What a shift did. `ok`: the candidate may take all traffic; otherwise traffic is
    back on `stable` and `event` is the ledger record that says why."""

    ok: bool
    problem: str | None = None
    detail: str = ""
    evidence: dict[str, Any] = Field(default_factory=dict)
    event: LedgerRecord | None = None


ShiftFn = Callable[[ShiftContext], ShiftResult]
"""Moves part of the traffic to the candidate before the switch (canary steps), under the
deploy lock; on a False result the deploy stops the candidate and records the failure."""

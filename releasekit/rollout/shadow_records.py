"""The shadow's records: its error, the shadow in force in an environment, a comparison of
the candidate with stable, and their local JSON copies (`<state dir>/shadow/`; the ledger
decides, these only show)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from releasekit.config import Settings
from releasekit.config.lanes import flat_name
from releasekit.errors import ReleasekitError
from releasekit.evaluate.agreement import Agreement
from releasekit.evaluate.answers import AnswerVerdict
from releasekit.rollout.judge import StepJudgement

ShadowVerdict = Literal["pass", "breach", "insufficient"]


class ShadowError(ReleasekitError):
    """Raised when shadowing cannot start or be read: nothing serves the environment, the
    candidate already takes traffic there, its server did not start, or no shadow runs."""

    remedy = "promote a release to the environment first; `releasekit shadow start` a candidate"


class ShadowStatus(BaseModel):
    """The shadow in force in one environment."""

    env: str
    release_id: str
    stable_release_id: str | None
    share: float
    base_url: str
    started_at: float
    reused_server: bool = False
    baseline_url: str | None = Field(
        None, description="the fresh baseline server of stable that gets the same copies"
    )


class ShadowComparison(BaseModel):
    """The candidate's live figures against stable's over one window."""

    env: str
    release_id: str
    stable_release_id: str
    verdict: ShadowVerdict
    window_s: float
    at: float
    judgement: StepJudgement
    mirrored: int = Field(0, description="copies sent in the window")
    dropped: int = Field(0, description="copies dropped in the window (mirror at its cap)")
    reason: str = ""
    seq: int | None = Field(None, description="the ledger record of this comparison")
    agreement: AnswerVerdict | Agreement | None = Field(
        None, description="the answers' agreement on the window's mirrored requests"
    )
    exact_answers: AnswerVerdict | None = Field(
        None,
        description="what exact match would have said of the same pairs, where the "
        "environment compares otherwise (shown beside the verdict; it decides nothing)",
    )
    judged_against: Literal["fresh baseline", "live server"] = Field(
        "live server",
        description="what the candidate's figures were compared with: a fresh server of "
        "stable given the same copies, or the long-running live server",
    )
    page: str | None = Field(
        None, description="the comparison's HTML page (disagreeing pairs side by side)"
    )
    clamped: str = Field(
        "",
        description="what of the checks the environment's ceilings clamped "
        "(rollout.ceilings: 'clamped by staging's policy: ...'; empty: none)",
    )
    unconfirmed: StepJudgement | None = Field(
        None,
        description="a first window whose live figures breached and the next window, judged "
        "on its own, did not repeat (a start-up transient; `judgement` is that next window's)",
    )


def shadow_dir(settings: Settings) -> Path:
    """Where the shadow's status and comparisons are kept: `<state dir>/shadow/`."""
    return settings.state_dir / "shadow"


def read_shadow(settings: Settings, env: str) -> ShadowStatus | None:
    """The shadow running in `env`, or None."""
    try:
        return ShadowStatus.model_validate_json((shadow_dir(settings) / f"{env}.json").read_bytes())
    except (OSError, ValidationError, ValueError):
        return None


def read_comparison(settings: Settings, env: str, release_id: str) -> ShadowComparison | None:
    """The latest shadow comparison of `release_id` in `env`, or None."""
    path = shadow_dir(settings) / f"{flat_name(env)}-{release_id[:16]}.comparison.json"
    try:
        cmp = ShadowComparison.model_validate_json(path.read_bytes())
    except (OSError, ValidationError, ValueError):
        return None
    return cmp if cmp.release_id == release_id else None

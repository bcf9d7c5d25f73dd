"""A canary in progress, on disk: which release, at which step, run by which process.

`promote` writes `STATE_DIR/rollouts/ENV.json` when a canary step starts and removes it
when the canary ends; it names the servers whose scheduler priority the canary raised, so
that whoever finds the canary interrupted puts them back, and a fresh baseline server it
started, so that it is stopped. A file whose process is gone
means a `promote` died mid-canary: the gateway's lease has put all traffic back on stable
by then (within `canary_lease_s`), and the next `promote` to the environment resumes the
canary at that step (`--resume`, same release) or records it as aborted.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from releasekit._support.files import write_atomic
from releasekit.config import Settings
from releasekit.deploy.state import proc_start_time, same_process


class HeldServer(BaseModel):
    """A server whose scheduler priority or CPU binding the canary changed while judged
    (put back after)."""

    pid: int
    proc_start: int | None = None
    release_id: str
    raised: bool = Field(False, description="its autogroup priority was raised")
    affinity: dict[int, list[int]] = Field(
        default_factory=dict, description="thread id -> the cores it was bound to before"
    )


class RolloutState(BaseModel):
    """One environment's canary in progress."""

    env: str
    release_id: str
    stable_release_id: str | None
    step: int
    steps: int
    weight: float
    pid: int
    proc_start: int | None = None
    started_at: float
    updated_at: float
    held: list[HeldServer] = Field(
        default_factory=list, description="servers at the judged priority (reset when it ends)"
    )
    baseline: HeldServer | None = Field(
        None, description="a fresh baseline server the canary started (stopped when it ends)"
    )

    @property
    def orphaned(self) -> bool:
        """True when the process that ran the canary is gone."""
        return not same_process(self.pid, self.proc_start)


def state_path(settings: Settings, env: str) -> Path:
    """Where the environment's canary state lives."""
    return settings.state_dir / "rollouts" / f"{env}.json"


def read_rollout(settings: Settings, env: str) -> RolloutState | None:
    """The canary in progress in `env`, or None (a garbled file counts as none)."""
    try:
        return RolloutState.model_validate_json(state_path(settings, env).read_bytes())
    except (OSError, ValidationError, ValueError):
        return None


def write_rollout(
    settings: Settings,
    *,
    env: str,
    release_id: str,
    stable_release_id: str | None,
    step: int,
    steps: int,
    weight: float,
    started_at: float | None = None,
    held: list[HeldServer] | None = None,
    baseline: HeldServer | None = None,
) -> RolloutState:
    """Record that this process runs `env`'s canary at `step` (0-based)."""
    now = time.time()
    st = RolloutState(
        env=env,
        release_id=release_id,
        stable_release_id=stable_release_id,
        step=step,
        steps=steps,
        weight=weight,
        pid=os.getpid(),
        proc_start=proc_start_time(os.getpid()),
        started_at=started_at or now,
        updated_at=now,
        held=list(held or []),
        baseline=baseline,
    )
    path = state_path(settings, env)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, st.model_dump_json(indent=2).encode())
    return st


def clear_rollout(settings: Settings, env: str) -> None:
    """Forget `env`'s canary (it ended)."""
    with contextlib.suppress(FileNotFoundError):
        state_path(settings, env).unlink()

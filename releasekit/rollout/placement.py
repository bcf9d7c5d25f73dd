"""Placement while a candidate is judged against stable on one host: the same scheduler
priority for both servers and, with `canary_judge_spread`, every thread of both free on every
core (`even_out`), put back afterwards (`release`). Used by canary steps and by shadow
comparisons alike, so both compare like with like.
"""

from __future__ import annotations

from collections.abc import Sequence

from releasekit.config import Settings
from releasekit.deploy.state import ServerRecord, read_state, same_process
from releasekit.promote.deploy import ShiftContext
from releasekit.rollout.state import HeldServer
from releasekit.serving.host import (
    raise_priority,
    reset_priority,
    restore_affinity,
    spread_session,
)


def judged_servers(settings: Settings, ctx: ShiftContext) -> list[ServerRecord]:
    """The canary's own local server and the local servers of stable's live routes, when
    the canary has its own server (they are then judged against each other); else []."""
    if any(r.base_url == ctx.canary.base_url for r in ctx.stable):
        return []
    urls = {ctx.canary.base_url: ctx.canary.release_id}
    urls |= {r.base_url: r.release_id for r in ctx.stable if r.weight > 0}
    return [
        s
        for s in read_state(settings.state_dir, ctx.env).servers
        if urls.get(s.base_url) == s.release_id
        and s.target == "local"
        and same_process(s.pid, s.proc_start)
    ]


def even_out(settings: Settings, ctx: ShiftContext) -> list[HeldServer]:
    """Judge the canary's and stable's servers under the same conditions while the steps
    run: the same scheduler priority (`canary_judge_nice`) and, with
    `canary_judge_spread`, every thread of both free to run on every core. Returns the
    servers changed, for `release`.

    Measured on the demo's 2-core host (benchmarks/canary_placement.py: two servers that
    serve alike, half the traffic each, 12 streaming clients): each worker bound to its
    own core, the gateway, both API servers and the clients run wherever there is room.
    Canary / stable engine TPOT p95 was 0.44 with only the canary raised to nice -5 (what
    `canary_nice` did), 1.28 with neither raised (the canary's core is the one the others
    crowd), 0.60-0.77 with both raised but bound, and 1.04-1.12 with both raised and
    spread over both cores."""
    nice = settings.canary_judge_nice
    if nice is None and not settings.canary_judge_spread:
        return []
    held: list[HeldServer] = []
    for s in judged_servers(settings, ctx):
        raised = nice is not None and raise_priority(s.pid, nice)
        affinity = spread_session(s.pid) if settings.canary_judge_spread else {}
        if raised or affinity:
            held.append(
                HeldServer(
                    pid=s.pid,
                    proc_start=s.proc_start,
                    release_id=s.release_id,
                    raised=raised,
                    affinity=affinity,
                )
            )
    return held


def release(held: Sequence[HeldServer]) -> None:
    """Put back what `even_out` changed on the servers still running: the default
    priority, and each thread's binding."""
    for h in held:
        if same_process(h.pid, h.proc_start):
            if h.raised:
                reset_priority(h.pid)
            restore_affinity(h.affinity)

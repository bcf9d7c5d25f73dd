"""A mirror's answer pair as the live answer comparison reads it: which answer is the
reference, which the judged release's, and which the reference's A/A (floor) copy."""

from __future__ import annotations

from releasekit.deploy.gateway import MirrorPair
from releasekit.evaluate.answers import ComparedRequest


def _ok(status: int | str | None) -> bool:
    return isinstance(status, int) and 200 <= status < 300


def _side(p: MirrorPair, side: str) -> str | None:
    """One side's answer text, or None when it did not complete (a status not 2xx, a cut
    or unreadable answer). A pair recorded before the sides' own flags: a side is whole when
    the pair is, else when its status and text are fine and the other side's are not."""
    text: str | None = getattr(p, side)
    status = getattr(p, f"{side}_status")
    whole: bool | None = getattr(p, f"{side}_complete")
    if whole is None:
        other = "candidate" if side == "stable" else "stable"
        other_fine = _ok(getattr(p, f"{other}_status")) and getattr(p, other) is not None
        whole = p.complete or (_ok(status) and text is not None and not other_fine)
    return text if whole and _ok(status) and text is not None else None


def compared(p: MirrorPair) -> ComparedRequest:
    """The pair's answers mapped to reference, judged and floor by its purpose. Shadow: the
    reference is the live release's answer the client got (`stable`), the judged the
    candidate's copy's. Canary: the reference is the copy's from the live release
    (`stable`), the judged the canary's the client got (`candidate`). After a promotion:
    the reference is the copy's from the previous release (`candidate`), the judged the new
    live release's the client got (`stable`). The floor is always the reference release's
    second answer. A side that did not complete is None (a difference)."""
    stable, candidate = _side(p, "stable"), _side(p, "candidate")
    if p.purpose == "after_promotion":
        reference, judged = candidate, stable
    else:
        reference, judged = stable, candidate
    floor = p.floor if p.has_floor and p.floor_complete and _ok(p.floor_status) else None
    return ComparedRequest(
        seq=p.seq,
        client=p.client,
        sampled=p.sampled,
        reference=reference,
        judged=judged,
        floor=floor,
        has_floor=p.has_floor,
        prompt=p.prompt,
        prompt_sha256=p.prompt_sha256,
    )


__all__ = ["compared"]

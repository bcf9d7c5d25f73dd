"""The mirror's answer pairs as the admin API answers them and the disk copy stores them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from releasekit.deploy.gateway.config import MirrorPurpose

TEXT_MAX = 4096
"""Characters of one answer (or one prompt) a pair keeps at most."""


class MirrorPair(BaseModel):
    """One mirrored request's two answers: the stable release's and the candidate's (the
    release under judgement). In a shadow the client got the stable side's answer; in a
    canary's pairs (`purpose` canary, `client_side` candidate) the client got the
    candidate's (the canary's) and the stable side is the copy's. Never a header or a key;
    the prompt only where it may be kept."""

    seq: int
    at: float = Field(description="when the pair completed (unix time)")
    path: str
    stable_release_id: str
    candidate_release_id: str
    stable_status: int | str
    candidate_status: int | str
    stable: str | None = Field(description="the client's answer text (None: unreadable)")
    candidate: str | None = Field(description="the candidate's answer text")
    complete: bool = Field(description="both answered 2xx and both answers were read whole")
    sampled: bool = Field(
        False,
        description="the request samples (temperature not 0, or n > 1): its two "
        "answers may differ by chance, so exact agreement does not judge them",
    )
    truncated: bool = Field(False, description="an answer was cut at TEXT_MAX characters")
    prompt_sha256: str = Field(description="sha256 of the client's request body")
    prompt: str | None = Field(None, description="the prompt text, only where it may be kept")
    purpose: MirrorPurpose = Field("shadow", description="why the request was copied")
    client_side: Literal["stable", "candidate"] = Field(
        "stable", description="whose answer the client got (the other side is the copy's)"
    )


class MirrorPairs(BaseModel):
    """`GET /admin/mirror/pairs`: the pairs held with seq > `since`, oldest first."""

    release_id: str | None = Field(description="the mirror's candidate (None: no mirror)")
    recorded: int = Field(
        0,
        description="the last pair's seq: pairs recorded by this mirror (with the gateway's "
        "pairs_dir, counted on from the candidate's pairs on disk)",
    )
    kept: int = Field(0, description="pairs held now")
    capacity: int = 0
    keep_prompts: bool = False
    purpose: MirrorPurpose | None = Field(None, description="the mirror's purpose")
    pairs: list[MirrorPair] = Field(default_factory=list)

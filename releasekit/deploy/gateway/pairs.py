"""The mirror's answer pairs as the admin API answers them and the disk copy stores them,
and the digest that names a pair's client."""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, Field

from releasekit.deploy.gateway.config import MirrorPurpose

TEXT_MAX = 4096
"""Characters of one answer (or one prompt) a pair keeps at most."""


def client_digest(client: str) -> str:
    """How a pair names its client: the gateway's key digest (`key:<blake2b>`) as it is, an
    address as `addr:<blake2b, 12 bytes>`; never the raw key or address ("" stays "")."""
    if not client or client.startswith(("key:", "addr:")):
        return client
    return "addr:" + hashlib.blake2b(client.encode(), digest_size=12).hexdigest()


class MirrorPair(BaseModel):
    """One mirrored request's answers: the stable release's and the candidate's (the
    release under judgement), and with `has_floor` a second answer of the reference release
    (the A/A or floor copy). In a shadow the client got the stable side's answer; in a
    canary's pairs (`purpose` canary, `client_side` candidate) the client got the
    candidate's (the canary's) and the stable side is the copy's; after a promotion the
    client got the stable side's (the new live release's) and the candidate side is the
    copy's to the previous release. The floor copy goes to the reference release: a shadow's
    to the fresh baseline or, without one, to the client's release under its pair label; a
    canary's and an after-promotion mirror's to the mirror's route, as a second copy. Never a
    header or a key (`client` is a digest); the prompt only where it may be kept."""

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
    stable_complete: bool | None = Field(
        None, description="the stable side answered 2xx, read whole (None: an older pair)"
    )
    candidate_complete: bool | None = Field(
        None, description="the candidate side answered 2xx, read whole (None: an older pair)"
    )
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
    client: str = Field(
        "", description="digest of the client's key (key:...) or address (addr:...)"
    )
    has_floor: bool = Field(False, description="a floor (A/A) copy was sent for this request")
    floor: str | None = Field(None, description="the floor copy's answer text")
    floor_status: int | str | None = Field(None, description="the floor copy's status")
    floor_release_id: str | None = Field(
        None, description="the route the floor copy went to (its label: a baseline's own)"
    )
    floor_complete: bool = Field(
        False, description="the floor copy answered 2xx and its answer was read whole"
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

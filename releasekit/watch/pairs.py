"""After a promotion: the live release's answers compared with the previous release's on the
same live requests, judged by the watch.

Where the environment's committed policy sets `after_promotion_compare_s` > 0, a promotion
keeps the previous release's server warm and sets the gateway's mirror to it
(`releasekit.promote.deploy`: `Mirror.purpose` `after_promotion`, `until` the window's
end): `after_promotion_share` of the live requests is copied there, and the gateway keeps
each copy's answer beside the one the client got (`GET /admin/mirror/pairs`). In these
pairs the stable side is the new live release (what clients got) and the candidate side
the previous release.

`AnswerWatch.check` runs on every watch tick: it reads the pairs recorded since its last
read, keeps the complete, non-sampled ones whose stable side is the live release (a copy
that failed, a cut answer, a sampled request are counted, never judged), and judges all
the window's pairs with `releasekit.evaluate.agreement` (the shadow comparison's exact
agreement and Wilson interval, with the policy's `shadow_min_agreement` and
`shadow_min_pairs`):

- fewer judged pairs than the minimum: `insufficient`, shown as "not judged yet (n of
  min pairs)": never a breach and never a pass;
- the interval's upper bound below the floor: `breach`; the watch rolls back through the
  same guarded rollback as a rule breach, with `evidence()` (counts, interval, up to 10
  disagreeing pairs) in the rollback's ledger event;
- at the window's end (the watch's clock past `until`) without a rollback: `finish`
  removes the mirror (under the deploy lock, only if it is still the same one) and
  records the result as a signed `shadow` ledger event (`action: after_promotion`, its
  verdict pass, insufficient or breach, and the agreement).

The gateway stops copying by itself past `until`, and the previous release's server is
kept warm past it, so no copy goes to a server that is gone; a promote or rollback
replaces the table, which ends the mirror too.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from releasekit._support.files import write_atomic
from releasekit._support.html import Templates
from releasekit.config import Settings
from releasekit.deploy.gateway import GatewayError, Mirror, MirrorPair, RouteTable
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.state import GatewayRecord, locked_state, read_state
from releasekit.errors import ReleasekitError
from releasekit.evaluate.agreement import Agreement, AnswerPair, answer_agreement
from releasekit.promote.report import TEMPLATE_DIR
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord

log = logging.getLogger(__name__)

MAX_PAIRS = 20_000
"""Answer pairs one window keeps at most (the latest): the watch's memory bound."""
MAX_READS = 50
"""Pages of pairs one check reads at most (the gateway answers 2,000 a page)."""
EVIDENCE_TEXT_MAX = 500
"""Characters of one answer or prompt a ledger event keeps."""

CheckStatus = Literal["running", "ended"]


class AnswersCheck(BaseModel):
    """One tick's judgement of the after-promotion comparison."""

    env: str
    release_id: str = Field(description="the live release (the pairs' stable side)")
    previous_release_id: str = Field(description="the release the copies went to")
    share: float
    until: float | None = None
    window_left_s: float | None = Field(None, description="by the watch's clock (0: over)")
    mirrored: int = Field(0, description="copies the gateway sent so far")
    dropped: int = Field(0, description="copies the gateway dropped (at its cap)")
    pairs_read: int = Field(0, description="pairs read since the promotion, judged or not")
    agreement: Agreement
    status: CheckStatus = "running"
    problem: str | None = Field(None, description="why the pairs could not be read now")
    record_seq: int | None = Field(None, description="the ledger event of the result")
    page: str | None = Field(
        None, description="the comparison's HTML page (written on a breach and at the end)"
    )

    @property
    def verdict(self) -> str:
        return self.agreement.verdict

    def line(self) -> str:
        """The comparison in one line, for the watch's output."""
        a = self.agreement
        if a.verdict == "insufficient":
            judged = f"not judged yet ({a.pairs} of {a.min_pairs} pairs"
            judged += f"; {a.not_judged} not judged)" if a.not_judged else ")"
        else:
            judged = f"{a.line()}: {a.verdict}"
        left = (
            "window over"
            if self.status == "ended"
            or (self.window_left_s is not None and self.window_left_s <= 0)
            else f"{self.window_left_s:.0f} s left"
            if self.window_left_s is not None
            else "no end"
        )
        return (
            f"answers vs {self.previous_release_id[:12]}: {judged}; {self.share:.0%} "
            f"mirrored, {self.mirrored} copies ({self.dropped} dropped), {left}"
            + (f"; {self.problem}" if self.problem else "")
        )

    def evidence(self) -> dict[str, Any]:
        """What a ledger event holds: the comparison, the agreement's counts and interval,
        at most 10 disagreeing pairs (texts cut at EVIDENCE_TEXT_MAX characters; a prompt
        only where the environment keeps prompts, else its digest)."""
        a = self.agreement
        return {
            "check": "after_promotion_agreement",
            "release_id": self.release_id,
            "previous_release_id": self.previous_release_id,
            "share": self.share,
            "until": self.until,
            "mirrored": self.mirrored,
            "dropped": self.dropped,
            "pairs_read": self.pairs_read,
            "page": self.page,
            "agreement": a.evidence(text_max=EVIDENCE_TEXT_MAX),
        }


def answer_pair(p: MirrorPair) -> AnswerPair:
    """A gateway pair as the agreement judges it: only complete, non-sampled ones count."""
    return AnswerPair(
        seq=p.seq,
        stable=p.stable,
        candidate=p.candidate,
        judged=p.complete and not p.sampled,
        prompt=p.prompt,
        prompt_sha256=p.prompt_sha256,
    )


class AnswerWatch:
    """The after-promotion comparison of one environment, followed tick by tick. The pairs
    read are kept per mirror (a new mirror starts afresh), at most MAX_PAIRS."""

    def __init__(
        self,
        settings: Settings,
        env: str,
        *,
        ledger: Ledger,
        min_agreement: float,
        min_pairs: int,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.env = env
        self.ledger = ledger
        self.min_agreement = min_agreement
        self.min_pairs = min_pairs
        self.clock = clock
        self.timeout_s = timeout_s
        self._mirror: Mirror | None = None
        self._pairs: deque[AnswerPair] = deque(maxlen=MAX_PAIRS)
        self._since = 0
        self._read = 0
        self._done: Mirror | None = None  # finished or rolled back: never judged again

    def _reset(self, mirror: Mirror | None) -> None:
        self._mirror = mirror
        self._pairs.clear()
        self._since = 0
        self._read = 0

    def check(self, live_release_id: str) -> AnswersCheck | None:
        """Read the new pairs and judge the window's; None when no after-promotion mirror
        is in force (or this one was already finished)."""
        try:
            state = read_state(self.settings.state_dir, self.env)
        except ReleasekitError as exc:
            log.warning("after-promotion comparison of %s not read: %s", self.env, exc)
            return None
        m = state.mirror
        if m is None or m.purpose != "after_promotion" or m == self._done:
            if m is None:
                self._reset(None)
            return None
        if m != self._mirror:
            self._reset(m)
        problem = None
        mirrored = dropped = 0
        if state.gateway is None:
            problem = "no gateway runs"
        else:
            try:
                mirrored, dropped = self._read_pairs(state.gateway, m, live_release_id)
            except GatewayError as exc:
                problem = f"the gateway did not answer its pairs: {exc}"
        agreement = answer_agreement(
            list(self._pairs), min_agreement=self.min_agreement, min_pairs=self.min_pairs
        )
        now = self.clock()
        return AnswersCheck(
            env=self.env,
            release_id=live_release_id,
            previous_release_id=m.route.release_id,
            share=m.share,
            until=m.until,
            window_left_s=max(0.0, m.until - now) if m.until is not None else None,
            mirrored=mirrored,
            dropped=dropped,
            pairs_read=self._read,
            agreement=agreement,
            status="ended" if m.until is not None and now >= m.until else "running",
            problem=problem,
        )

    def _read_pairs(self, gw: GatewayRecord, m: Mirror, live: str) -> tuple[int, int]:
        with GatewayClient(gw.url, admin_token=gw.admin_token, timeout_s=self.timeout_s) as c:
            st = c.state()
            if st.mirror != m.route.release_id or st.mirror_purpose != "after_promotion":
                return 0, 0
            if st.mirror_pairs < self._since:  # the gateway restarted: its seqs began again
                self._since = 0
            for _ in range(MAX_READS):
                got = c.mirror_pairs(self._since)
                if got.release_id != m.route.release_id or not got.pairs:
                    break
                for p in got.pairs:
                    self._since = p.seq
                    self._read += 1
                    if p.stable_release_id == live and p.candidate_release_id == m.route.release_id:
                        self._pairs.append(answer_pair(p))
                if self._since >= got.recorded:
                    break
            return st.mirrored, st.mirror_dropped

    def settled(self) -> None:
        """The mirror was ended by a rollback: judge it no more."""
        self._done = self._mirror
        self._reset(None)

    def finish(self, check: AnswersCheck) -> AnswersCheck:
        """The window is over: remove the mirror (when it is still the one judged) and
        record the result as a signed `shadow` ledger event (`action: after_promotion`)."""
        m = self._mirror
        if m is None:
            return check
        try:
            problem = self._remove(m)
        except ReleasekitError as exc:  # the deploy lock is held: the next tick tries again
            return check.model_copy(update={"problem": f"mirror not removed yet: {exc}"})
        out = check.model_copy(update={"status": "ended", "problem": problem or check.problem})
        rec = self._record(out)
        self._done = m
        self._reset(None)
        return out.model_copy(update={"record_seq": rec.seq if rec is not None else None})

    def _remove(self, m: Mirror) -> str | None:
        """Take `m` off the gateway and out of the deploy state, if it is still there."""
        with locked_state(self.settings.state_dir, self.env, timeout_s=30) as handle:
            st = handle.state
            if st.mirror != m:
                return None  # replaced meanwhile (a promote or rollback)
            problem = None
            gw = st.gateway
            if gw is not None:
                try:
                    with GatewayClient(
                        gw.url, admin_token=gw.admin_token, timeout_s=self.timeout_s
                    ) as c:
                        c.set_routes(RouteTable(routes=list(st.routes)))
                except GatewayError as exc:  # it copies nothing past `until` anyway
                    problem = f"the gateway kept the mirror: {exc}"
            st.mirror = None
            handle.save()
            return problem

    def _record(self, check: AnswersCheck) -> LedgerRecord | None:
        a = check.agreement
        try:
            return self.ledger.append(
                Event(
                    type=EventType.SHADOW,
                    environment=self.env,
                    from_release=check.previous_release_id,
                    to_release=check.release_id,
                    reason=f"after-promotion comparison: {a.verdict} ({a.reason})"[:2000],
                    evidence={
                        "action": "after_promotion",
                        "verdict": a.verdict,
                        **check.evidence(),
                    },
                    live=False,
                    actor="releasekit-watch",
                )
            )
        except ReleasekitError as exc:
            log.warning("after-promotion result of %s not recorded: %s", self.env, exc)
            return None


TEMPLATES = Templates(Path(__file__).resolve().parent / "templates", below=[TEMPLATE_DIR])
"""The after-promotion comparison's page, in the gate report's layout."""


def answers_html(check: AnswersCheck) -> str:
    """The after-promotion comparison as a self-contained HTML page: what was compared,
    the agreement with its interval and the disagreeing pairs side by side (the live
    release's answer as "stable", the previous release's as "candidate"), escaped."""
    until = (
        dt.datetime.fromtimestamp(check.until, dt.UTC).isoformat(timespec="seconds")
        if check.until is not None
        else "no end"
    )
    return TEMPLATES.render("answers.html", check=check, until=until)


def write_answers_page(settings: Settings, check: AnswersCheck) -> AnswersCheck:
    """Write the comparison's page under the state dir's `watch/` (one per environment and
    release, replaced as the window goes on); the check with its path. A page that cannot
    be written is logged, never a reason to hold a rollback."""
    path = settings.state_dir / "watch" / f"{check.env}-{check.release_id[:16]}.answers.html"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, answers_html(check).encode())
    except OSError as exc:
        log.warning("after-promotion page of %s not written: %s", check.env, exc)
        return check
    return check.model_copy(update={"page": str(path)})

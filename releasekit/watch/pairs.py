"""After a promotion: the live release's answers compared with the previous release's on the
same live requests, judged by the watch on a fixed schedule of looks.

Where the environment's committed policy sets `after_promotion_compare_s` > 0, a promotion
keeps the previous release's server warm and sets the gateway's mirror to it
(`releasekit.promote.deploy`: `Mirror.purpose` `after_promotion`, `until` the window's
end): `after_promotion_share` of the live requests is copied there twice (the copy and its
A/A floor copy), and the gateway keeps the copies' answers beside the one the client got
(`GET /admin/mirror/pairs`). `promote.answer_pairs.compared` maps each pair: the reference
is the copy to the previous release, the judged answer what the client got from the new
live release, the floor the second copy to the previous release.

`AnswerWatch.check` runs on every watch tick and reads the pairs recorded since its last
read (those whose stable side is the live release). It judges them only at the looks of a
fixed analysis schedule: `after_promotion_looks` looks evenly spaced over the window (from
the promotion, `until - after_promotion_compare_s`, to `until`; the last look at the
window's end), each with `evaluate.answers.judge_answers` under the environment's answers
policy (each look at confidence 1 - 0.05 / looks) and its comparator (`exact`, `scorer`,
`judge`). A tick between looks judges nothing new: its check repeats the last look's
verdict and says when the next look is. Looks missed while the watch was down are one look.

- `insufficient` (too few pairs, or an interval across the margin) and `pass`: nothing is
  done; they end a run of breaching looks.
- `breach`: a rollback needs `after_promotion_sustain` breaching looks in a row (the
  window's last look breaches alone); the watch then rolls back through the same guarded
  rollback as a rule breach, with `evidence()` in the rollback's ledger event.
- `not_judged` (the comparator could not judge: a judge that is down) is never a pass and
  never a rollback; it neither ends nor extends a run of breaching looks.
- where the policy compares otherwise than by exact match (`scorer`, `judge`), each look
  also judges the same pairs by exact match (`exact_answers`): shown beside the verdict
  and recorded with it (`answers_exact`), never deciding. Its own run of breaching looks is
  kept the same way, so the check can say truthfully whether exact match would have rolled
  the release back (`exact_rollback_look`): a prompt fix that rewords right answers passes
  under `scorer` and would breach under `exact`.
- at the window's end (the watch's clock past `until`) without a rollback: `finish`
  removes the mirror (under the deploy lock, only if it is still the same one) and
  records the last look as a signed `shadow` ledger event (`action: after_promotion`, its
  verdict pass, insufficient, breach or not_judged).

Events carry counts, digests and pair seqs (`AnswerVerdict.evidence()`), the live release's
`answers_key` (which weights and prompts answered), the looks done and the policy's source:
never a prompt or an answer (the text stays in the gateway's pair store).

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
from releasekit.deploy.gateway import GatewayError, Mirror, RouteTable
from releasekit.deploy.gateway_client import GatewayClient
from releasekit.deploy.state import GatewayRecord, locked_state, read_state
from releasekit.errors import ReleasekitError
from releasekit.evaluate.agreement import Agreement
from releasekit.evaluate.answer_compare import ExactComparator
from releasekit.evaluate.answers import (
    AnswerPolicy,
    AnswerVerdict,
    Comparator,
    ComparedRequest,
    judge_answers,
)
from releasekit.promote.answer_pairs import compared
from releasekit.promote.answers_breach import answers_key
from releasekit.promote.context import load_release
from releasekit.promote.report import TEMPLATE_DIR
from releasekit.stores.ledger import Event, EventType, Ledger, LedgerRecord

log = logging.getLogger(__name__)

MAX_PAIRS = 20_000
"""Answer pairs one window keeps at most (the latest): the watch's memory bound."""
MAX_READS = 50
"""Pages of pairs one check reads at most (the gateway answers 2,000 a page)."""

CheckStatus = Literal["running", "ended"]


class AnswersCheck(BaseModel):
    """One tick's view of the after-promotion comparison: the last look's verdict, the
    schedule, and whether a rollback is due. An older check (exact agreement, judged every
    tick) still reads: its `agreement` is set and `answers` is not."""

    env: str
    release_id: str = Field(description="the live release (the judged side)")
    previous_release_id: str = Field(description="the release the copies went to")
    share: float
    until: float | None = None
    window_left_s: float | None = Field(None, description="by the watch's clock (0: over)")
    mirrored: int = Field(0, description="copies the gateway sent so far")
    dropped: int = Field(0, description="copies the gateway dropped (at its cap)")
    pairs_read: int = Field(0, description="pairs read since the promotion, judged or not")
    answers: AnswerVerdict | None = Field(None, description="the last look's verdict")
    looks_done: int = Field(0, description="looks of the schedule judged so far")
    looks: int = Field(1, description="looks the schedule plans over the window")
    judged_now: bool = Field(False, description="this tick was a look (else it repeats one)")
    next_look_at: float | None = Field(None, description="when the next look is (unix time)")
    next_look_in_s: float | None = Field(None, description="by the watch's clock")
    breaching_looks: int = Field(0, description="breaching looks in a row, up to the last")
    sustain: int = Field(1, description="breaching looks in a row a rollback needs")
    rollback_due: bool = Field(
        False, description="the last look breached, `sustain` in a row or at the window's end"
    )
    exact_answers: AnswerVerdict | None = Field(
        None,
        description="what exact match would have said of the same pairs at the last look, "
        "where the environment compares otherwise (shown beside the verdict; it decides "
        "nothing)",
    )
    exact_breaching_looks: int = Field(
        0, description="exact match's breaching looks in a row, up to the last (shown only)"
    )
    exact_rollback_look: int | None = Field(
        None,
        description="the first look at which exact match would have rolled back (`sustain` "
        "breaching looks in a row, or a breach at the window's last look); shown only",
    )
    answers_key: dict[str, str] | None = Field(
        None, description="the live release's answers key (model, prompts, serving digests)"
    )
    policy_source: dict[str, Any] | None = Field(
        None,
        description="where the policy came from (`promote.policy.PolicySource`, and `where` "
        "in words)",
    )
    agreement: Agreement | None = Field(
        None, description="an older check's exact agreement (read, never written)"
    )
    status: CheckStatus = "running"
    problem: str | None = Field(None, description="why the pairs could not be read now")
    record_seq: int | None = Field(None, description="the ledger event of the result")
    page: str | None = Field(
        None, description="the comparison's HTML page (written on a breach and at the end)"
    )

    @property
    def verdict(self) -> str:
        """The last look's verdict ("pending" before the first look)."""
        if self.answers is not None:
            return self.answers.verdict
        return self.agreement.verdict if self.agreement is not None else "pending"

    def _left(self) -> str:
        if self.status == "ended" or (self.window_left_s is not None and self.window_left_s <= 0):
            return "window over"
        return f"{self.window_left_s:.0f} s left" if self.window_left_s is not None else "no end"

    def line(self) -> str:
        """The comparison in one line, for the watch's output: the last look's verdict,
        its A/A floor and its power, then the schedule and the mirror."""
        prev = self.previous_release_id[:12]
        mirror = (
            f"{self.share:.0%} mirrored, {self.mirrored} copies ({self.dropped} dropped), "
            f"{self._left()}" + (f"; {self.problem}" if self.problem else "")
        )
        a = self.answers
        if a is None and self.agreement is not None:  # an older check
            return f"answers vs {prev}: {self.agreement.line()}: {self.verdict}; {mirror}"
        nxt = (
            f"; next look in {self.next_look_in_s:.0f} s" if self.next_look_in_s is not None else ""
        )
        if a is None:
            return (
                f"answers vs {prev}: no look yet (0 of {self.looks} looks, "
                f"{self.pairs_read} pairs read){nxt}; {mirror}"
            )
        look = f"look {self.looks_done} of {self.looks}" + ("" if self.judged_now else ", repeated")
        run = (
            f"; breaching looks in a row: {self.breaching_looks} of {self.sustain}"
            if self.breaching_looks
            else ""
        )
        return (
            f"answers vs {prev}: {a.line()} ({look}{run}){nxt} | {a.floor_line()} | "
            f"{a.power_line()} | {mirror}"
        )

    @property
    def exact_differs(self) -> bool:
        """Whether exact match would have said otherwise than the comparison judged: another
        verdict at this look, or a rollback at an earlier one that did not happen."""
        e = self.exact_answers
        if e is None:
            return False
        return e.verdict != self.verdict or (
            self.exact_rollback_look is not None and not self.rollback_due
        )

    def exact_line(self) -> str | None:
        """What exact match would have said, in one line (None where the environment
        compares by exact match, or before the first look): its verdict, and whether its
        own run of breaching looks would have rolled the release back."""
        e = self.exact_answers
        if e is None:
            return None
        line = f"under exact match (shown, not deciding): {e.line()}"
        if self.exact_rollback_look is not None and not self.rollback_due:
            line += f"; exact match would have rolled it back at look {self.exact_rollback_look}"
        elif e.verdict == "breach" and self.verdict != "breach":
            line += (
                f"; exact match: breach at this look ({self.exact_breaching_looks} of "
                f"{self.sustain} in a row), {self.verdict.replace('_', ' ')} as judged"
            )
        return line

    def evidence(self) -> dict[str, Any]:
        """What a ledger event holds: the last look's verdict (`answers`:
        `AnswerVerdict.evidence()`: counts, intervals, worse pair seqs and prompt digests; no
        text), the live release's answers key, the looks done, the policy's source and what
        was compared."""
        return {
            "check": "after_promotion_answers",
            "verdict": self.verdict,
            "release_id": self.release_id,
            "previous_release_id": self.previous_release_id,
            "share": self.share,
            "until": self.until,
            "mirrored": self.mirrored,
            "dropped": self.dropped,
            "pairs_read": self.pairs_read,
            "page": self.page,
            "answers": self.answers.evidence() if self.answers is not None else None,
            "answers_key": self.answers_key,
            "looks": self.looks_done,
            "looks_planned": self.looks,
            "breaching_looks": self.breaching_looks,
            "sustain": self.sustain,
            "policy_source": self.policy_source,
            **(
                {
                    "answers_exact": self.exact_answers.evidence(),
                    "exact_breaching_looks": self.exact_breaching_looks,
                    "exact_rollback_look": self.exact_rollback_look,
                }
                if self.exact_answers is not None
                else {}
            ),
        }


def breach_run(run: int, verdict: str) -> int:
    """Breaching looks in a row after a look with `verdict`: one more on a breach, none
    after a pass or insufficient, unchanged after `not_judged` (a look that could not judge
    says nothing)."""
    if verdict == "breach":
        return run + 1
    return run if verdict == "not_judged" else 0


def look_times(until: float, window_s: float, looks: int) -> list[float]:
    """The schedule: `looks` looks evenly spaced over the window that ends at `until`, the
    last at `until` itself."""
    start = until - max(0.0, window_s)
    return [start + (until - start) * k / looks for k in range(1, looks)] + [until]


class AnswerWatch:
    """The after-promotion comparison of one environment, followed tick by tick and judged
    at the schedule's looks. The pairs read are kept per mirror (a new mirror starts
    afresh, its looks too), at most MAX_PAIRS. `policy.looks` is the schedule's number of
    looks; `window_s` the window's length (`after_promotion_compare_s`)."""

    def __init__(
        self,
        settings: Settings,
        env: str,
        *,
        ledger: Ledger,
        policy: AnswerPolicy,
        comparator: Comparator,
        window_s: float,
        sustain: int = 1,
        policy_source: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 5.0,
    ) -> None:
        self.settings = settings
        self.env = env
        self.ledger = ledger
        self.policy = policy
        self.comparator = comparator
        self.window_s = window_s
        self.sustain = max(1, sustain)
        self.policy_source = policy_source
        self.clock = clock
        self.timeout_s = timeout_s
        self._mirror: Mirror | None = None
        self._pairs: deque[ComparedRequest] = deque(maxlen=MAX_PAIRS)
        self._since = 0
        self._read = 0
        self._looks_done = 0
        self._last: AnswerVerdict | None = None
        self._breaching = 0
        self._exact: AnswerVerdict | None = None  # shown beside the verdict, never deciding
        self._exact_breaching = 0
        self._exact_rollback_look: int | None = None
        self._keys: dict[str, dict[str, str] | None] = {}
        self._done: Mirror | None = None  # finished or rolled back: never judged again

    def _reset(self, mirror: Mirror | None) -> None:
        self._mirror = mirror
        self._pairs.clear()
        self._since = 0
        self._read = 0
        self._looks_done = 0
        self._last = None
        self._breaching = 0
        self._exact = None
        self._exact_breaching = 0
        self._exact_rollback_look = None

    def check(self, live_release_id: str) -> AnswersCheck | None:
        """Read the new pairs, and judge the window's at a look of the schedule; None when
        no after-promotion mirror is in force (or this one was already finished)."""
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
        now = self.clock()
        judged_now, next_at, last_look = self._look(m, now)
        v = self._last
        due = (
            v is not None
            and v.verdict == "breach"
            and (self._breaching >= self.sustain or last_look)
        )
        ended = m.until is not None and now >= m.until
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
            answers=v,
            looks_done=self._looks_done,
            looks=self.policy.looks,
            judged_now=judged_now,
            next_look_at=next_at,
            next_look_in_s=max(0.0, next_at - now) if next_at is not None else None,
            breaching_looks=self._breaching,
            sustain=self.sustain,
            rollback_due=due,
            exact_answers=self._exact,
            exact_breaching_looks=self._exact_breaching,
            exact_rollback_look=self._exact_rollback_look,
            answers_key=self.release_key(live_release_id) if due or ended else None,
            policy_source=self.policy_source,
            status="ended" if ended else "running",
            problem=problem,
        )

    def _look(self, m: Mirror, now: float) -> tuple[bool, float | None, bool]:
        """Judge the pairs when a look of the schedule is due: (judged now, the next look's
        time, the last look is done). A mirror without an end looks at every tick."""
        if m.until is None:
            times = None
            due = self._looks_done + 1
        else:
            times = look_times(m.until, self.window_s, self.policy.looks)
            due = sum(1 for t in times if t <= now)
        judged = due > self._looks_done
        if judged:
            pairs = list(self._pairs)
            v = judge_answers(pairs, self.policy, self.comparator)
            self._looks_done = due
            self._last = v
            self._breaching = breach_run(self._breaching, v.verdict)
            if self.policy.comparison != "exact":
                self._judge_exact(pairs, last=times is not None and due >= len(times))
        if times is None:
            return judged, None, False
        next_at = next((t for t in times if t > now), None)
        return judged, next_at, self._looks_done >= len(times)

    def _judge_exact(self, pairs: list[ComparedRequest], *, last: bool) -> None:
        """What exact match would have said of this look's pairs, and its own run of
        breaching looks (kept as the deciding one's): shown and recorded, never acted on."""
        e = judge_answers(pairs, self.policy, ExactComparator())
        self._exact = e
        self._exact_breaching = breach_run(self._exact_breaching, e.verdict)
        due = e.verdict == "breach" and (self._exact_breaching >= self.sustain or last)
        if due and self._exact_rollback_look is None:
            self._exact_rollback_look = self._looks_done

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
                        self._pairs.append(compared(p))
                if self._since >= got.recorded:
                    break
            return st.mirrored, st.mirror_dropped

    def release_key(self, release_id: str) -> dict[str, str] | None:
        """`release_id`'s answers key from its signed lock (None, logged, when its lock
        cannot be read); read once per release."""
        if release_id not in self._keys:
            try:
                info = load_release(self.settings, release_id, ledger=self.ledger)
                self._keys[release_id] = answers_key(dict(info.lock.inputs))
            except ReleasekitError as exc:
                log.warning("answers key of %s not read: %s", release_id[:12], exc)
                self._keys[release_id] = None
        return self._keys[release_id]

    def settled(self) -> None:
        """The mirror was ended by a rollback: judge it no more."""
        self._done = self._mirror
        self._reset(None)

    def finish(self, check: AnswersCheck) -> AnswersCheck:
        """The window is over: remove the mirror (when it is still the one judged) and
        record the last look as a signed `shadow` ledger event (`action: after_promotion`)."""
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
        reason = check.answers.reason if check.answers is not None else "no look judged"
        try:
            return self.ledger.append(
                Event(
                    type=EventType.SHADOW,
                    environment=self.env,
                    from_release=check.previous_release_id,
                    to_release=check.release_id,
                    reason=f"after-promotion comparison: {check.verdict} ({reason})"[:2000],
                    evidence={"action": "after_promotion", **check.evidence()},
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
    the schedule, and the last look's verdict per stratum with its A/A floor and power; the
    pairs whose answer was worse only as pair seqs and prompt digests (no text)."""

    def iso(t: float | None) -> str:
        if t is None:
            return "no end"
        return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")

    return TEMPLATES.render(
        "answers.html", check=check, until=iso(check.until), next_look=iso(check.next_look_at)
    )


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

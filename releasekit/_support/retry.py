"""One retry policy for every caller that retries: a limit in attempts or a deadline,
exponential backoff with full jitter under a cap, an HTTP `Retry-After` honoured, and only the
errors (or results) the caller names retried.

    policy = RetryPolicy(attempts=4, base_s=0.5, cap_s=30.0, retry_on=(httpx.HTTPError,))
    response = policy.call(lambda: client.post(url, json=body))

The n-th wait (n = 1, 2, ...) is uniform in [0, min(cap_s, base_s * 2**(n-1))] ("full
jitter": callers that failed together do not retry in lockstep); with `jitter=False` it is
that upper bound exactly, and with `growth=1` it is a fixed poll interval. When the failed
attempt's exception carries a `retry_after` attribute (an HTTP `Retry-After` value: seconds,
or an HTTP-date), the wait is what it asks, capped at `cap_s`. With a deadline no wait runs
past it, so the last attempt is made at the deadline. When the policy gives up, the last
error is raised (or, when results are retried, the last result is returned).

Built on tenacity (`Retrying`, `wait_random_exponential`, `stop_after_attempt`,
`stop_after_delay`); `sleep` and `rng` are injectable, so a test can record the waits the
policy computed instead of timing them.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import tenacity
from tenacity.stop import stop_base
from tenacity.wait import wait_base

T = TypeVar("T")

Sleep = Callable[[float], object]


def retry_after_s(value: object, *, now: dt.datetime | None = None) -> float | None:
    """The seconds an HTTP `Retry-After` value asks to wait: delta-seconds (a number or a
    string of digits) or an HTTP-date (a date already past asks for 0); None when `value` is
    absent or unreadable."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return max(0.0, float(value)) if math.isfinite(value) else None
    text = str(value).strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    now = now or dt.datetime.now(dt.UTC)
    return max(0.0, (when - now).total_seconds())


class _FullJitter(tenacity.wait_random_exponential):
    """tenacity's full-jitter wait, drawing from a given random generator (seedable)."""

    def __init__(self, *, base_s: float, cap_s: float, growth: float, rng: random.Random) -> None:
        super().__init__(multiplier=base_s, max=cap_s, exp_base=growth)
        self.rng = rng

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        high = tenacity.wait_exponential.__call__(self, retry_state)
        return self.rng.uniform(self.min, high)


class _PolicyWait(wait_base):
    """A failed attempt's `retry_after` (capped) when it carries one, else the backoff; never
    past the deadline."""

    def __init__(self, policy: RetryPolicy, backoff: wait_base) -> None:
        self.policy = policy
        self.backoff = backoff

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        p = self.policy
        wait: float | None = None
        outcome = retry_state.outcome
        if p.honour_retry_after and outcome is not None and outcome.failed:
            wait = retry_after_s(getattr(outcome.exception(), "retry_after", None))
            if wait is not None:
                wait = min(wait, p.cap_s)
        if wait is None:
            wait = float(self.backoff(retry_state))
        if p.deadline_s is not None:
            left = p.deadline_s - (retry_state.seconds_since_start or 0.0)
            wait = min(wait, max(0.0, left))
        return wait


@dataclass(frozen=True)
class RetryPolicy:
    """How a caller retries (see the module docstring).

    `attempts` counts every try, the first included (None: only the deadline limits);
    `deadline_s` is measured from the first try (None: only attempts limit). An exception is
    retried when it is an instance of `retry_on` and `retry_if` (when given) says so; any
    other exception is raised at once. A returned value is retried when `retry_result` (when
    given) says so."""

    attempts: int | None = 3
    deadline_s: float | None = None
    base_s: float = 0.5
    cap_s: float = 30.0
    growth: float = 2.0
    jitter: bool = True
    honour_retry_after: bool = True
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    retry_if: Callable[[BaseException], bool] | None = None
    retry_result: Callable[[Any], bool] | None = None
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.attempts is None and self.deadline_s is None:
            raise ValueError("a retry policy needs attempts or a deadline")
        if self.attempts is not None and self.attempts < 1:
            raise ValueError("attempts must be at least 1")

    @classmethod
    def every(
        cls,
        interval_s: float,
        *,
        deadline_s: float,
        retry_on: tuple[type[BaseException], ...] = (),
        retry_if: Callable[[BaseException], bool] | None = None,
        retry_result: Callable[[Any], bool] | None = None,
    ) -> RetryPolicy:
        """Try every `interval_s` (no growth, no jitter) until `deadline_s` has passed."""
        return cls(
            attempts=None,
            deadline_s=deadline_s,
            base_s=interval_s,
            cap_s=interval_s,
            growth=1.0,
            jitter=False,
            honour_retry_after=False,
            retry_on=retry_on,
            retry_if=retry_if,
            retry_result=retry_result,
        )

    @classmethod
    def poll(
        cls,
        *,
        interval_s: float,
        deadline_s: float,
        retry_on: tuple[type[BaseException], ...] = (),
    ) -> RetryPolicy:
        """`every(interval_s)` until a try returns something true, or until `deadline_s` has
        passed: what the last try returned (or raised) comes back."""
        return cls.every(interval_s, deadline_s=deadline_s, retry_on=retry_on, retry_result=_falsy)

    def backoff(self, attempt: int) -> float:
        """The wait after failed attempt number `attempt` (1, 2, ...) without a
        `Retry-After`: a draw from the jitter window (or its upper bound without jitter)."""
        state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
        state.attempt_number = attempt
        return float(self._backoff()(state))

    def _backoff(self) -> wait_base:
        if self.jitter:
            return _FullJitter(
                base_s=self.base_s, cap_s=self.cap_s, growth=self.growth, rng=self.rng
            )
        return tenacity.wait_exponential(
            multiplier=self.base_s, max=self.cap_s, exp_base=self.growth
        )

    def _kwargs(self, until: threading.Event | None) -> dict[str, Any]:
        stops: list[stop_base] = []
        if self.attempts is not None:
            stops.append(tenacity.stop_after_attempt(self.attempts))
        if self.deadline_s is not None:
            stops.append(tenacity.stop_after_delay(self.deadline_s))
        if until is not None:
            stops.append(tenacity.stop_when_event_set(until))

        def wanted(exc: BaseException) -> bool:
            return isinstance(exc, self.retry_on) and (self.retry_if is None or self.retry_if(exc))

        retry: tenacity.retry_base = tenacity.retry_if_exception(wanted)
        if self.retry_result is not None:
            retry = retry | tenacity.retry_if_result(self.retry_result)
        return {
            "stop": tenacity.stop_any(*stops),
            "wait": _PolicyWait(self, self._backoff()),
            "retry": retry,
            # Giving up: the last error is raised, or the last result returned.
            "retry_error_callback": _last_outcome,
        }

    def call(
        self,
        fn: Callable[[], T],
        *,
        sleep: Sleep = time.sleep,
        until: threading.Event | None = None,
        before_sleep: Callable[[int, BaseException | None, float], object] | None = None,
    ) -> T:
        """`fn()` retried under this policy. `until`: an event that, once set, ends the retries
        (pass `until.wait` as `sleep` to also cut a wait short). `before_sleep(attempt, error,
        wait)` is told of each retry (error: None when a result was retried)."""

        def wait(seconds: float) -> None:
            sleep(seconds)

        r = tenacity.Retrying(sleep=wait, before_sleep=_tell(before_sleep), **self._kwargs(until))
        return r(fn)

    async def acall(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        sleep: Callable[[float], Awaitable[object]] | None = None,
        before_sleep: Callable[[int, BaseException | None, float], object] | None = None,
    ) -> T:
        """`await fn()` retried under this policy, waiting with `asyncio.sleep` (or `sleep`)."""
        extra: dict[str, Any] = {} if sleep is None else {"sleep": sleep}
        r = tenacity.AsyncRetrying(before_sleep=_tell(before_sleep), **extra, **self._kwargs(None))
        return await r(fn)


def _falsy(value: object) -> bool:
    return not value


def _last_outcome(retry_state: tenacity.RetryCallState) -> Any:
    assert retry_state.outcome is not None  # tenacity calls this after an attempt
    return retry_state.outcome.result()  # raises the last error, if it was one


def _tell(
    before_sleep: Callable[[int, BaseException | None, float], object] | None,
) -> Callable[[tenacity.RetryCallState], None] | None:
    if before_sleep is None:
        return None

    def hook(rs: tenacity.RetryCallState) -> None:
        error = rs.outcome.exception() if rs.outcome is not None and rs.outcome.failed else None
        before_sleep(rs.attempt_number, error, rs.upcoming_sleep)

    return hook

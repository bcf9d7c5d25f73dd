"""A candidate's and stable's figures over one window: the warm-up burst to a fresh server,
scraping the gateway and both servers' /metrics at about one time, and the pair of release
windows between two scrapes (canary steps and the shadow comparison both use them)."""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import httpx

from releasekit.deploy.gateway import Route
from releasekit.rollout.judge import ReleaseWindows
from releasekit.watch.windows import (
    Exposition,
    ScrapeError,
    Snapshot,
    build_window,
    parse_exposition,
    scrape,
)

SHARED_SERVER = "both releases share one vLLM server (prompt-only canary)"

WARMUP_PROMPT = (
    "A release engineer checks a new model release before it takes live traffic. "
    "Describe in a few sentences what could go wrong and how to notice it early."
)
WARMUP_TOKENS = 16
WARMUP_TIMEOUT_S = 120.0


def warm_up_server(http: httpx.Client, route: Route, n: int) -> tuple[int, float]:
    """`n` short completions at once straight to `route`'s server (answers discarded): a
    fresh vLLM's first requests are slower than its steady state, and a judgement should
    not start on them. Returns (answered, seconds). Best effort."""
    headers = {"authorization": f"Bearer {route.api_key}"} if route.api_key else {}
    body = {
        "model": route.model or "",
        "prompt": WARMUP_PROMPT,
        "max_tokens": WARMUP_TOKENS,
        "temperature": 0,
    }
    answered: list[bool] = []

    def one() -> None:
        try:
            r = http.post(
                route.base_url + "/v1/completions",
                json=body,
                headers=headers,
                timeout=WARMUP_TIMEOUT_S,
            )
            answered.append(r.status_code == 200)
        except httpx.HTTPError:
            answered.append(False)

    t0 = time.time()
    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=WARMUP_TIMEOUT_S + 5)
    return sum(answered), round(time.time() - t0, 3)


class Scrape(NamedTuple):
    """The gateway's and both releases' vLLM expositions scraped at about one time; None
    where one was not scraped or did not answer, and `errors` says why, by role
    ("gateway", "candidate", "stable")."""

    at: float
    gateway: Exposition | None
    candidate: Exposition | None
    stable: Exposition | None
    errors: dict[str, str] = {}  # noqa: RUF012 (a NamedTuple default, never mutated)


def scrape_pair(
    http: httpx.Client,
    gateway_url: str,
    candidate_url: str | None,
    stable_url: str | None,
    *,
    timeout_s: float,
    unscraped: str = "not scraped",
) -> Scrape:
    """Scrape the gateway and (when given) both releases' vLLM /metrics now; a vLLM not
    given is recorded as `unscraped` (why it was not asked)."""
    errors: dict[str, str] = {}

    def one(role: str, url: str | None) -> Exposition | None:
        if url is None:
            errors[role] = unscraped
            return None
        try:
            return parse_exposition(
                scrape(url + "/metrics", timeout_s=timeout_s, client=http), url=url
            )
        except ScrapeError as exc:
            errors[role] = f"/metrics did not answer ({exc.problem})"
            return None

    return Scrape(
        time.time(),
        one("gateway", gateway_url),
        one("candidate", candidate_url),
        one("stable", stable_url),
        errors,
    )


def pair_windows(
    env: str, candidate_id: str, stable_id: str, before: Scrape, after: Scrape
) -> tuple[ReleaseWindows, ReleaseWindows]:
    """(candidate, stable) windows between two scrapes: each release's edge window from
    the gateway's per-release series, and its engine window from its own vLLM (None, with
    why in `engine_missing`, when either scrape lacks it)."""
    t0, t1 = before.at, after.at
    g0, g1 = before.gateway, after.gateway

    def rw(
        role: str, release_id: str, e0: Exposition | None, e1: Exposition | None
    ) -> ReleaseWindows:
        edge = build_window(
            Snapshot(t0, gateway=g0), Snapshot(t1, gateway=g1), env=env, release=release_id
        )
        engine, missing = None, None
        if e0 is not None and e1 is not None:
            engine = build_window(Snapshot(t0, vllm=e0), Snapshot(t1, vllm=e1))
        else:
            missing = after.errors.get(role) or before.errors.get(role) or "not scraped"
        return ReleaseWindows(
            release_id=release_id, edge=edge, engine=engine, engine_missing=missing
        )

    return (
        rw("candidate", candidate_id, before.candidate, after.candidate),
        rw("stable", stable_id, before.stable, after.stable),
    )

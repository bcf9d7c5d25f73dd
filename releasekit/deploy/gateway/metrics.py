"""The gateway's own Prometheus metrics (names and labels are a contract with the watcher)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from releasekit.deploy.gateway.routing import Table

TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
)  # fmt: skip
E2E_BUCKETS = (*TTFT_BUCKETS, 45.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.0001, 0.0005, *TTFT_BUCKETS)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, *TTFT_BUCKETS)

KNOWN_ROUTES = frozenset(
    {"completions", "chat/completions", "models", "embeddings", "responses", "tokenize"}
)


class ReleaseMetrics:
    """One release's labelled children of the per-release families (looked up once)."""

    __slots__ = ("chunks", "e2e", "in_flight", "overhead", "ttft", "upstream_wait")

    def __init__(self, m: Metrics, release: str) -> None:
        env = m.env
        self.in_flight = m.in_flight.labels(env, release)
        self.ttft = m.ttft.labels(env, release)
        self.e2e = m.e2e.labels(env, release)
        self.upstream_wait = m.upstream_wait.labels(env, release)
        self.overhead = m.overhead.labels(env, release)
        self.chunks = m.chunks.labels(env, release)


class Metrics:
    """The gateway's metric families (names are a contract with the watcher)."""

    def __init__(self, registry: CollectorRegistry, env: str) -> None:
        self.env = env
        rl = ["env", "release"]
        p = "releasekit_gateway_"
        self.requests = Counter(
            p + "requests", "Pinned requests by endpoint and status the client got",
            ["env", "release", "route", "status"], registry=registry,
        )  # fmt: skip
        self.in_flight = Gauge(p + "in_flight", "Pinned requests not finished", rl,
                               registry=registry)  # fmt: skip
        self.ttft = Histogram(p + "ttft_seconds", "Arrival to first content chunk (streams)",
                              rl, buckets=TTFT_BUCKETS, registry=registry)  # fmt: skip
        self.e2e = Histogram(p + "e2e_seconds", "Arrival to last byte relayed", rl,
                             buckets=E2E_BUCKETS, registry=registry)  # fmt: skip
        self.upstream_wait = Histogram(
            p + "upstream_wait_seconds", "Arrival to upstream response headers", rl,
            buckets=E2E_BUCKETS, registry=registry,
        )  # fmt: skip
        self.overhead = Histogram(
            p + "overhead_seconds", "Arrival to upstream request sent (gateway's share)", rl,
            buckets=OVERHEAD_BUCKETS, registry=registry,
        )  # fmt: skip
        self.queue_wait = Histogram(
            p + "queue_wait_seconds", "Admission wait for an in-flight slot", ["env"],
            buckets=QUEUE_BUCKETS, registry=registry,
        ).labels(env)  # fmt: skip
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a slot", ["env"],
                                 registry=registry).labels(env)  # fmt: skip
        self.chunks = Counter(p + "stream_chunks", "SSE chunks relayed", rl, registry=registry)
        self.stream_errors = Counter(
            p + "stream_errors", "Streams ended early", ["env", "release", "reason"],
            registry=registry,
        )  # fmt: skip
        self.rejections = Counter(p + "rejections", "Requests refused or failed by the gateway",
                                  ["env", "reason"], registry=registry)  # fmt: skip
        self.feedback = Counter(p + "feedback", "Feedback on responses",
                                ["env", "release", "score"], registry=registry)  # fmt: skip
        self.info = Gauge(p + "info", "1 per live route; weight = its traffic share",
                          ["env", "release", "weight"], registry=registry)  # fmt: skip
        self.weight = Gauge(p + "route_weight", "Traffic share per live route", rl,
                            registry=registry)  # fmt: skip
        self.generation = Gauge(p + "routes_generation", "Route-table version", ["env"],
                                registry=registry).labels(env)  # fmt: skip
        self.switches = Counter(p + "route_switches", "Route-table swaps", ["env"],
                                registry=registry).labels(env)  # fmt: skip
        self.mirrored = Counter(p + "mirrored", "Shadow copies sent or dropped",
                                ["env", "release", "outcome"], registry=registry)  # fmt: skip
        self.lease_expiries = Counter(
            p + "lease_expiries", "Leased tables that reverted to their fallback", ["env"],
            registry=registry,
        ).labels(env)  # fmt: skip
        self._rel: dict[str, ReleaseMetrics] = {}
        self._req: dict[tuple[str, str, int | str], Any] = {}
        self._rej: dict[str, Any] = {}
        self._info_labels: list[tuple[str, str]] = []

    def release(self, release: str) -> ReleaseMetrics:
        m = self._rel.get(release)
        if m is None:
            m = self._rel[release] = ReleaseMetrics(self, release)
        return m

    def request(self, release: str, route: str, status: int | str) -> None:
        key = (release, route, status)
        c = self._req.get(key)
        if c is None:
            c = self._req[key] = self.requests.labels(self.env, release, route, str(status))
        c.inc()

    def reject(self, reason: str) -> None:
        c = self._rej.get(reason)
        if c is None:
            c = self._rej[reason] = self.rejections.labels(self.env, reason)
        c.inc()

    def set_routes(self, table: Table) -> None:
        for labels in self._info_labels:
            with contextlib.suppress(KeyError):
                self.info.remove(self.env, *labels)
            with contextlib.suppress(KeyError):
                self.weight.remove(self.env, labels[0])
        self._info_labels = []
        for r in table.routes:
            share = table.share(r)
            if share <= 0:
                continue
            labels = (r.release_id, f"{share:.4g}")
            self.info.labels(self.env, *labels).set(1)
            self.weight.labels(self.env, r.release_id).set(share)
            self._info_labels.append(labels)
        self.generation.set(table.generation)


def endpoint_label(path: str) -> str:
    tail = path[4:] if path.startswith("/v1/") else path
    return tail if tail in KNOWN_ROUTES else "other"

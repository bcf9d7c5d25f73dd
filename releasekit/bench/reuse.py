"""A load test measured once per engine: the main sweep's figures depend on the engine (the
release's serving key: weights, chat template, quantisation, engine arguments and
environment), the locked load profile, the served name and the harness that drives it, and
on nothing else a release carries (prompts, suites, gates and adapters do not reach it: its
requests are the profile's own, sent to the base model). A build whose release has the same
`bench_key` as a registered release measured on this host kind cites that release's main
sweep instead of running it again, the way DVC does not rerun a stage whose inputs did not
change.

The cited sweep is read only as its release's verified register event signed it, and the
citation (`BenchResult.measured_for`: that release, its register event and the bench.json
digest it signed) is itself signed with the citing release; `check_citation` checks it again
in the evidence gate of every promotion (and so in `audit replay`). A release's adapter
sweeps, eval and server are always its own.

    key = bench_key(lock, manifest.served_name)
    found = find_measurement(settings, lock, manifest.served_name, host=measure_host())
    bench = cite(found, release_id=lock.release_id) if found else run_bench(...)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pydantic import ValidationError

from releasekit import __version__
from releasekit._support.digests import digest_obj, sha256_bytes
from releasekit.bench.result import BenchResult, MeasuredFor
from releasekit.config import Settings
from releasekit.errors import ReleasekitError
from releasekit.spec.lock import Lock, serving_key
from releasekit.spec.measured import MeasuredOn, same_host
from releasekit.stores.ledger import Ledger
from releasekit.stores.results import FILES
from releasekit.stores.verified import verify_release_evidence

_HARNESS_MODULES = ("loadgen.py", "runner.py", "scrape.py", "stats.py", "streams.py")


@cache
def harness_digest() -> str:
    """Digest of the code that drives and measures a sweep (load generator, runner, server
    scrape, statistics): any change to it makes every earlier measurement uncitable."""
    here = Path(__file__).resolve().parent
    return digest_obj(
        {
            "version": __version__,
            **{m: sha256_bytes((here / m).read_bytes()) for m in _HARNESS_MODULES},
        }
    )


def bench_key(lock: Lock, served_name: str) -> str:
    """What decides a release's main sweep: its serving key, its locked load profile, the
    name requests are sent to and the harness."""
    return digest_obj(
        {
            "serving": serving_key(lock),
            "profile": lock.inputs.get("load/profile"),
            "served_name": served_name,
            "harness": harness_digest(),
        }
    )


@dataclass(frozen=True)
class Measurement:
    """A registered release's main sweep that a build may cite."""

    bench: BenchResult
    source: MeasuredFor


def find_measurement(
    settings: Settings,
    lock: Lock,
    served_name: str,
    *,
    ledger: Ledger,
    host: MeasuredOn,
) -> Measurement | None:
    """The newest main sweep under results/ with the same `bench_key` as this release's,
    measured for its own release (not itself a citation) on this host kind and core count,
    and read as that release's verified register event signed it (bench.json and lock.json;
    the lock must give the same key). None when there is none: the build measures."""
    key = bench_key(lock, served_name)
    found: list[Measurement] = []
    root = settings.release_dir(lock.release_id).parent
    if not root.is_dir():
        return None
    for folder in sorted(root.iterdir()):
        rid = folder.name
        file = folder / FILES["bench"]
        if rid == lock.release_id or not file.is_file():
            continue
        try:
            data = json.loads(file.read_bytes())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("bench_key") != key or data.get("measured_for"):
            continue
        signed = _signed_measurement(settings, rid, ledger)
        if signed is None:
            continue
        m, src_lock = signed
        if m.bench.bench_key != key or same_host(m.bench.host, host) is not None:
            continue
        if bench_key(src_lock, m.bench.model) != key:
            continue
        found.append(m)
    found.sort(key=lambda m: m.bench.started_at)
    return found[-1] if found else None


def _signed_measurement(
    settings: Settings, rid: str, ledger: Ledger
) -> tuple[Measurement, Lock] | None:
    """Release `rid`'s main sweep and lock, each read as its verified register event signed
    it (one verification for both), or None."""
    ve = verify_release_evidence(settings, rid, ledger)
    if ve.problems_for("bench", "lock") or ve.register_seq is None:
        return None
    try:
        data = ve.read_bytes("bench")
        bench = BenchResult.model_validate_json(data)
        lock = Lock.model_validate_json(ve.read_bytes("lock"))
    except (ReleasekitError, ValidationError, ValueError):
        return None
    if bench.release_id != rid:
        return None
    source = MeasuredFor(
        release_id=rid, register_seq=ve.register_seq, bench_sha256=sha256_bytes(data)
    )
    return Measurement(bench=bench, source=source), lock


def cite(found: Measurement, *, release_id: str) -> BenchResult:
    """This release's bench result holding the cited main sweep as measured: its points,
    knee, host and figures unchanged, tagged with this release and the citation. Adapter
    sweeps and server memory are left to the citing build (its own server)."""
    return found.bench.model_copy(
        update={
            "release_id": release_id,
            "measured_for": found.source,
            "adapters": [],
            "adapter_sweeps": [],
            "server_memory_bytes": None,
        }
    )


_OWN_FIELDS = {
    "release_id",
    "measured_for",
    "adapters",
    "adapter_sweeps",
    "server_memory_bytes",
    "server_memory_peak_bytes",
    "requests",
}
"""What a citing release's bench.json holds of its own; everything else is the cited sweep."""


def check_citation(
    settings: Settings, bench: BenchResult, lock: Lock, ledger: Ledger
) -> str | None:
    """Why a bench result's citation does not hold (None: it does, or it cites nothing): the
    cited release's bench.json must be the one its verified register event signed, with the
    digest the citation names, its lock must give the same bench key as `lock`, and the
    sweep must be the cited one, figure for figure."""
    src = bench.measured_for
    if src is None:
        return None
    short = src.release_id[:12]
    ve = verify_release_evidence(settings, src.release_id, ledger)
    probs = ve.problems_for("bench", "lock")
    if probs:
        return f"the load test it cites (release {short}) cannot be checked: {probs[0]}"
    try:
        data = ve.read_bytes("bench")
        cited = BenchResult.model_validate_json(data)
        src_lock = Lock.model_validate_json(ve.read_bytes("lock"))
    except (ReleasekitError, ValidationError, ValueError) as exc:
        why = exc.message if isinstance(exc, ReleasekitError) else str(exc).splitlines()[0]
        return f"the load test it cites (release {short}) is unreadable: {why}"
    if sha256_bytes(data) != src.bench_sha256 or ve.register_seq != src.register_seq:
        return (
            f"it cites release {short}'s load test as register event #{src.register_seq} "
            f"signed it, and that is not the one signed now"
        )
    same = (
        bench.bench_key is not None
        and bench.bench_key == cited.bench_key
        and serving_key(src_lock) == serving_key(lock)
        and src_lock.inputs.get("load/profile") == lock.inputs.get("load/profile")
    )
    if not same:
        return (
            f"release {short} ran another engine or load profile: its load test is not this one's"
        )
    mine = bench.model_dump(mode="json", exclude=_OWN_FIELDS)
    theirs = cited.model_dump(mode="json", exclude=_OWN_FIELDS)
    if mine != theirs:
        return f"the sweep differs from release {short}'s load test, which it cites"
    return None

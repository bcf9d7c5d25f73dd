"""The build stages DVC runs (`releasekit stage KIND`): quantise, bench, eval, report."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from releasekit._support.files import write_atomic
from releasekit._support.procs import (
    sigterm_as_interrupt,
)
from releasekit._support.progress import (
    Progress,
)
from releasekit.config import Settings
from releasekit.errors import BuildError, LockMismatchError, ReleasekitError
from releasekit.serving.vllm import serve_release
from releasekit.spec import lock as lockmod
from releasekit.spec.loadprofile import load_profile
from releasekit.spec.lock import Lock
from releasekit.spec.manifest import LoadedManifest, load_manifest
from releasekit.stores.results import ReleasePaths

if TYPE_CHECKING:
    from releasekit.bench.reuse import Measurement
    from releasekit.serving.vllm import Served


def _checked_lock(settings: Settings, lm: LoadedManifest, release_id: str) -> Lock:
    """The manifest's lock, after checking that the inputs still lock to `release_id`."""
    try:
        lockmod.check(lm.path, root=settings.root)
    except LockMismatchError as exc:
        raise BuildError(
            f"{lm.path}: inputs changed since dvc.yaml was written ({', '.join(exc.changed)})",
            remedy="run `releasekit build MANIFEST` (it relocks and rewrites the stages)",
        ) from exc
    lk = lockmod.read_lock(lockmod.lock_path_for(lm.path))
    if lk.release_id != release_id:
        raise BuildError(
            f"{lm.path} locks to release {lk.short_id}, but this stage is for {release_id[:12]}",
            remedy="run `releasekit build MANIFEST` (it rewrites the stages in dvc.yaml)",
        )
    return lk


def run_stage(
    settings: Settings,
    kind: StageKind,
    manifest_path: Path | str,
    *,
    release_id: str,
    baseline_release_id: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Run one build stage of a locked release and return the folder it wrote. This is what
    `releasekit stage KIND MANIFEST --release ID` (the command in dvc.yaml) calls."""
    say = progress or (lambda label, done, total: None)
    lm = load_manifest(manifest_path, root=settings.root)
    lk = _checked_lock(settings, lm, release_id)
    ReleasePaths.of(settings, release_id).root.mkdir(parents=True, exist_ok=True)
    with sigterm_as_interrupt():
        if kind == "quantise":
            return _stage_quantise(settings, lm, lk, say)
        if kind == "bench":
            return _stage_bench(settings, lm, lk, say)
        if kind == "eval":
            return _stage_eval(settings, lm, lk, say)
        if kind == "evidence":
            return _stage_evidence(settings, lm, lk, say)
        if kind == "report":
            return _stage_report(settings, lm, lk, baseline_release_id, say)
    raise BuildError(f"unknown stage kind {kind!r}")


def _stage_quantise(settings: Settings, lm: LoadedManifest, lk: Lock, say: Progress) -> Path:
    from releasekit.build.quantise import quantise_release

    paths = ReleasePaths.of(settings, lk.release_id)
    write_atomic(paths.lock, (lk.model_dump_json(indent=2) + "\n").encode())
    write_atomic(paths.manifest, lm.path.read_bytes())
    quantise_release(settings, lm, lk, progress=say)
    return paths.root


def _stage_bench(settings: Settings, lm: LoadedManifest, lk: Lock, say: Progress) -> Path:
    from releasekit.bench import bench_release

    _, out = bench_release(
        lm.path,
        settings=settings,
        out_dir=ReleasePaths.of(settings, lk.release_id).bench_dir,
        progress=say,
    )
    return out


def _stage_eval(settings: Settings, lm: LoadedManifest, lk: Lock, say: Progress) -> Path:
    from releasekit.evaluate import run_eval, write_outputs

    m = lm.manifest
    out = ReleasePaths.of(settings, lk.release_id).eval_dir
    out.mkdir(parents=True, exist_ok=True)
    say("starting vLLM", 0, 0)
    with serve_release(settings, lm, lk, log_path=out / "server.log") as server:
        result = run_eval(
            server.base_url, m.served_name, lm, release_id=lk.release_id, progress=say
        )
        server.check_alive()
    write_outputs(result, out)
    return out


def _stage_evidence(settings: Settings, lm: LoadedManifest, lk: Lock, say: Progress) -> Path:
    """Load test and evaluation on one vLLM server: a cold build starts vLLM once per release
    (bench first, on an idle server: the main sweep on the base, then for a release with
    adapters the sweeps with 1 to max-loras adapters in traffic; then the suites). Writes
    bench/ and eval/. A release that cites its load test may run on the server the release
    before it in the same build left running on its engine (`releasekit.build.engines`)."""
    from releasekit.bench import write_outputs as write_bench
    from releasekit.bench.release import add_adapter_sweeps, bench_served
    from releasekit.bench.reuse import cite
    from releasekit.evaluate import run_eval
    from releasekit.evaluate import write_outputs as write_eval

    m = lm.manifest
    paths = ReleasePaths.of(settings, lk.release_id)
    paths.bench_dir.mkdir(parents=True, exist_ok=True)
    paths.eval_dir.mkdir(parents=True, exist_ok=True)
    profile = load_profile(lm.resolve(m.load.profile))
    cited = _cited_measurement(settings, lm, lk) if settings.bench_reuse else None
    with _evidence_server(settings, lm, lk, kept_ok=cited is not None, say=say) as (
        server,
        loaded_bytes,
    ):
        if cited is not None:
            bench = cite(cited, release_id=lk.release_id)
            say(f"load test: cited from release {cited.source.release_id[:12]}", 1, 1)
        else:
            bench = bench_served(server, m, lk, profile, progress=say)
            server.check_alive()
            bench.server_memory_peak_bytes = server.memory_bytes()
        bench.server_memory_bytes = loaded_bytes
        add_adapter_sweeps(bench, server, m, profile, progress=say)
        server.check_alive()
        evaluation = run_eval(
            server.base_url, m.served_name, lm, release_id=lk.release_id, progress=say
        )
        server.check_alive()  # a server that died mid-way left errors, not evidence
    write_bench(bench, paths.bench_dir)
    write_eval(evaluation, paths.eval_dir)
    return paths.root


@contextlib.contextmanager
def _evidence_server(
    settings: Settings, lm: LoadedManifest, lk: Lock, *, kept_ok: bool, say: Progress
) -> Iterator[tuple[Served, int | None]]:
    """The release's server and the memory it held once loaded. Outside a build that keeps
    servers, a fresh one, stopped at the end. Inside one (`EnginePool.from_env`): with
    `kept_ok`, the server the build kept on this engine if any, holding this release's
    adapters; else a fresh one (every kept server stopped first). Either is left running
    for the next release when the block succeeds; its part of the log goes to server.log."""
    from releasekit.build.engines import (
        EnginePool,
        KeptEngine,
        attach,
        copy_log_part,
        hold_adapters,
    )
    from releasekit.serving.vllm import api_key_of, release_adapters, release_model_dir
    from releasekit.spec.lock import serving_key

    paths = ReleasePaths.of(settings, lk.release_id)
    pool = EnginePool.from_env(grace_s=settings.server_stop_grace_s)
    if pool is None:
        say("starting vLLM", 0, 0)
        with serve_release(settings, lm, lk, log_path=paths.root / "server.log") as fresh:
            say("starting vLLM", 1, 1)
            yield fresh, fresh.memory_bytes()
        return
    key, api_key = serving_key(lk), api_key_of(lm.manifest)
    model_dir = release_model_dir(settings, lm, lk)
    kept = pool.take(key, model_dir, api_key) if kept_ok else None
    if kept is not None:
        say(f"vLLM kept from release {kept.started_for[:12]}", 0, 0)
        adapters = release_adapters(settings, lm, lk)
        log, offset = Path(kept.log_path), _size(Path(kept.log_path))
        try:
            hold_adapters(kept.base_url, adapters, api_key)
            yield attach(kept, adapters), kept.loaded_bytes
        except BaseException:
            pool.drop(kept.pid)
            raise
        finally:
            copy_log_part(
                log,
                offset,
                paths.root / "server.log",
                f"# releasekit: the vLLM server (pid {kept.pid}) started for release "
                f"{kept.started_for} on this engine (serving key {key[:12]}); its log from "
                "where this release's stage took it",
            )
        return
    pool.clear()  # one engine at a time: nothing idles beside a server being measured
    say("starting vLLM", 0, 0)
    log = pool.log_path(lk.release_id)
    server = serve_release(settings, lm, lk, log_path=log, die_with_parent=False)
    try:
        server.start()
        say("starting vLLM", 1, 1)
        loaded = server.memory_bytes()
        yield server, loaded
        engine = KeptEngine(
            pid=server.detach(),
            base_url=server.base_url,
            serving_key=key,
            model_dir=str(model_dir),
            served_name=lm.manifest.served_name,
            log_path=str(log),
            loaded_bytes=loaded,
            started_for=lk.release_id,
        )
        pool.keep(engine)
    finally:
        server.stop()  # a no-op once handed on
        copy_log_part(
            log,
            0,
            paths.root / "server.log",
            "# releasekit: the vLLM server started for this release",
        )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _cited_measurement(settings: Settings, lm: LoadedManifest, lk: Lock) -> Measurement | None:
    """The registered main sweep this release may cite (`releasekit.bench.reuse`): same
    engine, load profile, served name and harness, on this host kind, as signed. None when
    there is none or the ledger cannot be read (the build then measures)."""
    from releasekit.bench.reuse import find_measurement
    from releasekit.spec.measured import measure_host
    from releasekit.stores.ledger import open_ledger

    try:
        ledger = open_ledger(settings, read_only=True)
    except ReleasekitError:
        return None
    try:
        return find_measurement(
            settings, lk, lm.manifest.served_name, ledger=ledger, host=measure_host()
        )
    finally:
        ledger.close()


def _stage_report(
    settings: Settings,
    lm: LoadedManifest,
    lk: Lock,
    baseline_release_id: str | None,
    say: Progress,
) -> Path:
    from releasekit.evaluate import compare, load_result, write_report

    if baseline_release_id is None:
        raise BuildError(f"{lm.path}: the report stage needs --baseline RELEASE_ID")
    cand = ReleasePaths.of(settings, lk.release_id)
    base = ReleasePaths.of(settings, baseline_release_id)
    say("compare", 0, 1)
    comparison = compare(load_result(cand.eval_dir), load_result(base.eval_dir), lm)
    out = cand.report_dir
    cand_bench, base_bench = cand.bench, base.bench
    write_report(
        comparison,
        out,
        candidate_bench=cand_bench if cand_bench.is_file() else None,
        baseline_bench=base_bench if base_bench.is_file() else None,
    )
    say("compare", 1, 1)
    return out


StageKind = Literal["quantise", "bench", "eval", "evidence", "report"]

"""Benching a locked release on its own vLLM server: the main sweep on the base, then, for a
release with LoRA adapters, the adapter sweeps on the same engine."""

from __future__ import annotations

from pathlib import Path

from releasekit._support.procs import sigterm_as_interrupt
from releasekit._support.progress import Progress
from releasekit.bench.adapter_sweep import max_loras_of, run_adapter_sweeps
from releasekit.bench.result import BenchResult
from releasekit.bench.runner import PointCallback, run_bench, write_outputs
from releasekit.config import Settings
from releasekit.serving.vllm import Served, api_key_of, serve_release
from releasekit.spec.loadprofile import LoadProfile, load_profile
from releasekit.spec.lock import Lock, locked_release, serving_args
from releasekit.spec.manifest import Manifest


def add_adapter_sweeps(
    bench: BenchResult,
    server: Served,
    manifest: Manifest,
    profile: LoadProfile,
    *,
    progress: Progress | None = None,
) -> BenchResult:
    """After the main sweep (the base alone, as every gate compares it), a release with
    adapters runs `run_adapter_sweeps` on the same server (which holds its adapters under
    their names) up to its serving arguments' max-loras, and records them and its adapters'
    names in `bench`. A release without adapters is left as it is."""
    if not manifest.adapters:
        return bench
    args = serving_args(manifest)
    bench.adapters = [a.name for a in manifest.adapters]
    bench.adapter_sweeps = run_adapter_sweeps(
        server.base_url,
        manifest.served_name,
        {name: server.adapters[name] for name in bench.adapters},
        profile,
        max_loras=max_loras_of(args),
        api_key=api_key_of(manifest),
        max_num_seqs=max_num_seqs_of(args),
        progress=progress,
    )
    return bench


def max_num_seqs_of(args: dict[str, str]) -> int | None:
    """The release's max-num-seqs engine argument, when it sets one."""
    raw = args.get("max-num-seqs")
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def bench_served(
    server: Served,
    manifest: Manifest,
    lock: Lock,
    profile: LoadProfile,
    *,
    progress: Progress | None = None,
    on_point: PointCallback | None = None,
    repetitions: int | None = None,
) -> BenchResult:
    """The main sweep of `profile` on `server`, which serves the locked release: as its
    served model, with its API key and max-num-seqs, the result tagged with its release id
    and the profile's locked digest. `repetitions` overrides the profile's; only a sweep
    with the profile's own carries its `bench_key` (`releasekit.bench.reuse`)."""
    from releasekit.bench.reuse import bench_key

    result = run_bench(
        server.base_url,
        manifest.served_name,
        profile,
        release_id=lock.release_id,
        profile_digest=lock.inputs.get("load/profile"),
        progress=progress,
        on_point=on_point,
        api_key=api_key_of(manifest),
        repetitions=repetitions,
        max_num_seqs=max_num_seqs_of(serving_args(manifest)),
    )
    if repetitions is None:  # the profile's own sweep: what another build of the engine may cite
        result.bench_key = bench_key(lock, manifest.served_name)
    return result


def bench_release(
    manifest_path: Path | str,
    *,
    settings: Settings,
    out_dir: Path | None = None,
    port: int | None = None,
    progress: Progress | None = None,
    on_point: PointCallback | None = None,
    repetitions: int | None = None,
) -> tuple[BenchResult, Path]:
    """Lock a manifest, serve its release (`releasekit.server.serve_release`: the quantised
    model under results/<release_id>/ once built, else model.source; its exact engine
    arguments and environment), run its load profile, write the outputs (default
    results/<release_id>/bench) and stop the server, also on Ctrl-C or SIGTERM. The server
    listens on `port`, or on a free one. `repetitions` overrides the profile's. A release
    with adapters also runs the adapter sweeps (`add_adapter_sweeps`).

    Raises ReleaseNotBuiltError for a quantised release that was not built yet.

    Returns the result and the folder it was written to.
    """
    lm, lk = locked_release(manifest_path, root=settings.root)
    m = lm.manifest
    profile = load_profile(lm.resolve(m.load.profile))
    out = out_dir or settings.release_dir(lk.release_id) / "bench"
    out.mkdir(parents=True, exist_ok=True)
    server = serve_release(settings, lm, lk, port=port, log_path=out / "server.log")
    with sigterm_as_interrupt():
        if progress is not None:
            progress("starting vLLM", 0, 0)
        with server:
            if progress is not None:
                progress("starting vLLM", 1, 1)
            result = bench_served(
                server,
                m,
                lk,
                profile,
                progress=progress,
                on_point=on_point,
                repetitions=repetitions,
            )
            add_adapter_sweeps(result, server, m, profile, progress=progress)
            # A server that died during the sweeps left errors, not evidence.
            server.check_alive()
    write_outputs(result, out)
    return result, out

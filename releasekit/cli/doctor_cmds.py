"""CLI: `releasekit doctor`, what this host has and which schemes its vLLM can serve."""

from __future__ import annotations

import typer

from releasekit.cli._common import JsonOpt, State, emit_json, esc, handle_errors, out, table
from releasekit.serving.doctor import DoctorReport, doctor


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("doctor")(doctor_cmd)


def _gib(v: int | None) -> str:
    return "?" if v is None else f"{v / 2**30:.1f} GiB"


def _status(status: str | None, servable: bool | None) -> str:
    """yes / no / not verified (a kernel path never seen serving) / not checked."""
    if status == "not verified":
        return status
    return {True: "yes", False: "no", None: "not checked"}[servable]


def _render(r: DoctorReport) -> None:
    flags = " ".join(f"{f}={'yes' if on else 'no'}" for f, on in r.cpu.flags.items())
    out.print(f"cpu: {esc(r.cpu.model or 'unknown')}, {r.cpu.cores} cores", highlight=False)
    out.print(f"cpu flags: {esc(flags)}", highlight=False)
    out.print(
        f"memory: {_gib(r.memory.total_bytes)} total, {_gib(r.memory.available_bytes)} available",
        highlight=False,
    )
    if r.gpus:
        for g in r.gpus:
            out.print(
                f"gpu {g.index}: {esc(g.name)}, {_gib(g.memory_bytes)}, capability "
                f"{g.capability or '?'} (from {r.gpu_source})",
                highlight=False,
            )
    else:
        out.print("gpus: none (no NVIDIA driver lists a GPU, torch sees none)", highlight=False)
    v = r.vllm
    build = f"{v.distribution} {v.version}, {v.build} build" if v.build else "not installed"
    lib = f", kernels {v.kernel_library}" if v.kernel_library else ""
    out.print(f"vllm: {esc(build)}{esc(lib)} ({esc(v.python)})", highlight=False)
    torch = f"{v.torch_version}" + (f", CUDA {v.torch_cuda}" if v.torch_cuda else "")
    out.print(f"torch: {esc(torch if v.torch_version else 'not installed')}", highlight=False)
    out.print(
        f"stack: installed {r.installed_stack or 'unknown'}, scripts/install.sh would pick "
        f"{r.install_would_pick} (RELEASEKIT_STACK=cuda|cpu forces)",
        highlight=False,
    )
    out.print("schemes this host's vLLM can serve:", highlight=False)
    for sc in r.schemes:
        shown = _status(sc.status, sc.servable)
        out.print(f"  {sc.scheme:<12} {shown:<4} {esc(sc.how)}", highlight=False)
    table(
        "manifests",
        ["manifest", "scheme", "servable"],
        [(m.path, m.scheme or "-", _status(m.status, m.servable)) for m in r.manifests],
    )
    for line in r.summary:
        out.print(f"- {esc(line)}", highlight=False)


@handle_errors
def doctor_cmd(json_: JsonOpt = False) -> None:
    """Show this host's CPU flags, memory and GPUs, the installed stack, which quantisation
    schemes its vLLM can serve and what that means for the project's manifests."""
    report = doctor(State.settings())
    if json_:
        emit_json(report)
    else:
        _render(report)

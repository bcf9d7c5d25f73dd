"""`releasekit doctor`: what this host has (CPU flags, memory, GPUs, the installed stack and
its vLLM build), which quantisation schemes that vLLM can serve here, and what that means for
the project's manifests (the demo's variants)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from releasekit.config import Settings
from releasekit.errors import ManifestError
from releasekit.spec.hostcaps import (
    SCHEMES,
    CpuFacts,
    GpuFacts,
    HostFacts,
    MemoryFacts,
    SchemeStatus,
    SchemeSupport,
    VllmFacts,
    host_facts,
    scheme_support,
)
from releasekit.spec.manifest import Scheme, load_manifest

Stack = Literal["cpu", "cuda"]


class ManifestVerdict(BaseModel):
    """One manifest of the project against this host."""

    path: str
    name: str | None = None
    scheme: str | None = None
    servable: bool | None = None
    status: SchemeStatus | None = None
    how: str


class DoctorReport(BaseModel):
    """What `releasekit doctor` found: the host, its stack, the schemes and the manifests."""

    cpu: CpuFacts
    memory: MemoryFacts
    gpus: list[GpuFacts]
    gpu_source: Literal["nvidia-smi", "torch", "none"]
    install_would_pick: Stack = Field(
        description="the stack scripts/install.sh picks on this host (RELEASEKIT_STACK unset)"
    )
    installed_stack: Stack | None = Field(
        None, description="the stack the installer recorded in the serving environment"
    )
    vllm: VllmFacts
    quantise_device: str = Field(description="where llm-compressor would run here")
    schemes: list[SchemeSupport]
    manifests: list[ManifestVerdict]
    summary: list[str] = Field(description="what this host means for the demo, in sentences")


def _installed_stack(python: Path) -> Stack | None:
    marker = python.parent.parent / ".releasekit-stack"
    try:
        value = marker.read_text().strip()
    except OSError:
        return None
    return value if value in ("cpu", "cuda") else None  # type: ignore[return-value]


def _manifest_verdicts(root: Path, support: dict[Scheme, SchemeSupport]) -> list[ManifestVerdict]:
    out = []
    for path in sorted((root / "manifests").glob("*.yaml")):
        rel = path.relative_to(root).as_posix()
        try:
            m = load_manifest(path, root=root).manifest
        except ManifestError as exc:
            out.append(ManifestVerdict(path=rel, how=f"not a valid manifest: {exc.problems[0]}"))
            continue
        s = support[m.quantisation.scheme]
        out.append(
            ManifestVerdict(
                path=rel,
                name=m.name,
                scheme=m.quantisation.scheme,
                servable=s.servable,
                status=s.status,
                how=s.how,
            )
        )
    return out


def _summary(facts: HostFacts, schemes: list[SchemeSupport], quantise_device: str) -> list[str]:
    v = facts.vllm
    lines = []
    if v.build is None:
        lines.append(
            f"no vLLM for {v.python}: nothing can be served from this environment "
            "(run scripts/install.sh)"
        )
    else:
        where = "the GPU" if v.build == "cuda" else "the CPU"
        lines.append(f"vLLM {v.version} ({v.distribution}, {v.build} build) serves on {where}")
    yes = [s.scheme for s in schemes if s.servable]
    no = [s for s in schemes if s.servable is False]
    if yes:
        lines.append(f"servable here: {', '.join(yes)}")
    if no:
        lines.append(f"not servable here: {', '.join(s.scheme for s in no)} (reasons above)")
    unseen = [s.scheme for s in schemes if s.status == "not verified"]
    if unseen:
        lines.append(f"not verified here: {', '.join(unseen)} (never seen serving; see above)")
    lines.append(f"quantisation (llm-compressor) runs on {quantise_device}")
    if not facts.gpus:
        lines.append(
            "no NVIDIA GPU: the roofline uses host memory bandwidth, and GPU figures "
            "(benchmarks/gpu_check.py) cannot be measured here"
        )
    return lines


def doctor(settings: Settings) -> DoctorReport:
    """Inspect this host and the serving interpreter (`settings.python`); never starts vLLM.
    Takes a couple of seconds (the serving interpreter imports torch once)."""
    facts = host_facts(settings.python, with_torch=True)
    driver_lists_gpus = bool(facts.gpus)
    gpus, source = facts.gpus, facts.gpu_source
    if not gpus and facts.vllm.torch_devices:
        gpus, source = facts.vllm.torch_devices, "torch"
        facts = facts.model_copy(update={"gpus": gpus, "gpu_source": source})
    schemes = [scheme_support(s, facts) for s in SCHEMES]
    support = {s.scheme: s for s in schemes}
    if facts.vllm.torch_devices:
        d = facts.vllm.torch_devices[0]
        quantise_device = f"cuda:0 ({d.name})"
    elif facts.vllm.torch_version is None:
        quantise_device = "nowhere: no torch in the serving environment"
    else:
        quantise_device = "cpu (torch sees no GPU)"
    return DoctorReport(
        cpu=facts.cpu,
        memory=facts.memory,
        gpus=gpus,
        gpu_source=source,
        install_would_pick="cuda" if driver_lists_gpus else "cpu",
        installed_stack=_installed_stack(settings.python),
        vllm=facts.vllm,
        quantise_device=quantise_device,
        schemes=schemes,
        manifests=_manifest_verdicts(settings.root, support),
        summary=_summary(facts, schemes, quantise_device),
    )

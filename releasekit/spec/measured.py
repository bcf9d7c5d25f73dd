"""Where a measurement was made: the host kind (CPU vendor, model and instruction-set level,
GPUs), the cores the measuring process could run on, and the host's load at the start and
end. bench.json and eval.json carry it (`host`), so that a perf comparison of two releases
is made only between measurements of one host kind and core count
(`releasekit.promote.gates`), and a knee is applied only to replicas with the cores it was
measured on (`releasekit.deploy.ray.autoscale`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from releasekit.spec.hostcaps import cpu_facts, nvidia_gpus


class MeasuredOn(BaseModel):
    """The host a bench or eval result was measured on."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    cpu_vendor: str | None = Field(None, description="vendor_id, e.g. GenuineIntel, AuthenticAMD")
    cpu_model: str | None = Field(None, description="model name, as /proc/cpuinfo gives it")
    isa: str = Field(
        "unknown",
        description="the instruction-set level vLLM's CPU build picks its kernels by: "
        "amx, avx512_bf16, avx512, avx2 or baseline",
    )
    gpus: list[str] = Field(default_factory=list, description="NVIDIA GPU names, if any")
    cores: int = Field(ge=1, description="cores the measuring process could run on")
    load_start: float | None = Field(None, description="1-minute load average at the start")
    load_end: float | None = Field(None, description="1-minute load average at the end")

    @property
    def kind(self) -> tuple[str | None, str | None, str, tuple[str, ...]]:
        """What must be equal for two measurements to be compared: vendor, model, ISA level
        and GPUs (the core count is compared on its own)."""
        return (self.cpu_vendor, self.cpu_model, self.isa, tuple(self.gpus))

    @property
    def label(self) -> str:
        """The host in words: `AMD EPYC 9B14 (avx512_bf16), 2 cores`."""
        cpu = self.cpu_model or self.cpu_vendor or "unknown CPU"
        gpus = f", {', '.join(self.gpus)}" if self.gpus else ""
        return f"{cpu} ({self.isa}){gpus}, {self.cores} core{'s' if self.cores != 1 else ''}"

    @property
    def load_text(self) -> str:
        """The load average at the start and end, in words ('' when not recorded)."""
        if self.load_start is None and self.load_end is None:
            return ""
        fmt = lambda v: "?" if v is None else f"{v:.2f}"  # noqa: E731
        return f"load {fmt(self.load_start)} -> {fmt(self.load_end)}"

    def ended(self) -> MeasuredOn:
        """This record with the load average now as its end."""
        return self.model_copy(update={"load_end": _loadavg()})


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - no load average on this platform
        return None


def _vendor(cpuinfo: Path) -> str | None:
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "vendor_id":
                return value.strip() or None
    return None


def isa_level(flags: dict[str, bool]) -> str:
    """The CPU's level as vLLM's CPU build sees it, from the hostcaps CPU_FLAGS."""
    if flags.get("amx_tile") and flags.get("amx_bf16"):
        return "amx"
    if flags.get("avx512f") and flags.get("avx512_bf16"):
        return "avx512_bf16"
    if flags.get("avx512f"):
        return "avx512"
    if flags.get("avx2"):
        return "avx2"
    return "baseline"


def measure_host(
    cpuinfo: Path = Path("/proc/cpuinfo"), *, gpus: list[str] | None = None
) -> MeasuredOn:
    """This host, now (the load average now as `load_start`). `gpus` None: asks nvidia-smi."""
    cpu = cpu_facts(cpuinfo)
    names = [g.name for g in nvidia_gpus()] if gpus is None else gpus
    return MeasuredOn(
        cpu_vendor=_vendor(cpuinfo),
        cpu_model=cpu.model,
        isa=isa_level(cpu.flags) if any(cpu.flags.values()) or cpu.model else "unknown",
        gpus=names,
        cores=max(1, cpu.cores),
        load_start=_loadavg(),
    )


def same_host(a: MeasuredOn | None, b: MeasuredOn | None) -> str | None:
    """Why two measurements cannot be compared as from one host (None: they can): one
    records no host, the host kinds differ, or the core counts do."""
    if a is None or b is None:
        return "no host recorded (measured before releasekit recorded where)"
    if a.kind != b.kind:
        return "another host kind"
    if a.cores != b.cores:
        return f"another core count ({a.cores} and {b.cores})"
    return None

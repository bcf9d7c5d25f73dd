"""A server with LoRA adapters: `VLLMServer(..., adapters=...)` loads them once the base is
healthy, under their names, and a refused adapter fails the start with the engine's reason
and no process left; `serve_release` stages a release's adapters and hands them over.

Fast tests use a stand-in engine (a small HTTP server with vLLM's run-time LoRA endpoints and
refusals); the slow test serves the demo base with a random peft adapter on the real vLLM."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import webclient
import yaml

from releasekit.config import Settings
from releasekit.errors import AdapterLoadError
from releasekit.serving.adapters import (
    RUNTIME_ENV,
    ensure_adapters,
    load_adapter,
    loaded_adapters,
    unload_adapter,
)
from releasekit.serving.vllm import ServerInfo, VLLMServer, serve_release
from releasekit.spec.adapters import weights_digest
from releasekit.spec.lock import locked_release

LORA_ARGS = {"enable-lora": "", "max-loras": "2", "max-lora-rank": "8"}

# A stand-in for vLLM's API server: /health, /version, /v1/models (the base, then each loaded
# adapter with its parent and root) and /v1/load_lora_adapter, which (like vLLM) needs
# VLLM_ALLOW_RUNTIME_LORA_UPDATING and refuses a rank above --max-lora-rank with a 500.
FAKE_ENGINE = textwrap.dedent(
    """
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    argv = sys.argv[1:]
    if argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
        argv = argv[2:]
    opts = {argv[i][2:]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    served, max_rank = opts["served-model-name"], int(opts.get("max-lora-rank", "16"))
    runtime = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "True"
    loras = {}
    pidfile = os.environ.get("FAKE_PIDFILE")
    if pidfile:
        open(pidfile, "w").write(str(os.getpid()))

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def send(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                data = [{"id": served, "root": opts["model"], "parent": None}]
                data += [{"id": n, "root": p, "parent": served} for n, p in loras.items()]
                self.send(200, {"data": data})
            elif self.path == "/version":
                self.send(200, {"version": "fake"})
            else:
                self.send(200, {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/load_lora_adapter" or not runtime:
                return self.send(404, {"detail": "Not Found"})
            path = body["lora_path"]
            try:
                rank = json.load(open(os.path.join(path, "adapter_config.json")))["r"]
            except OSError:
                return self.send(404, {"error": {"message": f"No adapter found for {path}"}})
            if rank > max_rank:
                msg = f"LoRA rank {rank} is greater than max_lora_rank {max_rank}."
                return self.send(500, {"error": {"message": msg, "code": 500}})
            loras[body["lora_name"]] = path
            self.send(200, {})

    HTTPServer((opts["host"], int(opts["port"])), H).serve_forever()
    """
)


def fake_python(tmp_path: Path) -> Path:
    """An 'interpreter' that runs the stand-in engine with vLLM's argv."""
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(0o755)
    return exe


def make_adapter(folder: Path, *, rank: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16}))
    (folder / "adapter_model.safetensors").write_bytes(b"lora" * rank)
    return folder


def gone(pgid: int, wait_s: float = 10.0) -> bool:
    """True once no process of group `pgid` is left (waiting up to `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


class WatchedServer(VLLMServer):
    """A VLLMServer that remembers its process group, to check none of it is left."""

    pgid: int | None = None

    def _load_adapters(self) -> None:
        self.pgid = self.proc.pid if self.proc else None
        super()._load_adapters()


def stand_in_server(tmp_path: Path, adapters: dict[str, Path]) -> WatchedServer:
    return WatchedServer(
        tmp_path,
        served_name="demo",
        engine_args=LORA_ARGS,
        env={"FAKE_PIDFILE": str(tmp_path / "engine.pid")},
        python=fake_python(tmp_path),
        log_path=tmp_path / "server.log",
        start_timeout_s=30,
        stop_grace_s=2,
        adapters=adapters,
    )


def test_adapters_are_loaded_under_their_names_once_the_base_is_healthy(tmp_path: Path) -> None:
    ad = make_adapter(tmp_path / "ad", rank=8)
    server = stand_in_server(tmp_path, {"json-ad": ad})
    assert server.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    with server:
        models = webclient.get(f"{server.base_url}/v1/models").json()["data"]
        held = {m["id"]: m for m in models}
        assert held["json-ad"]["parent"] == "demo" and held["json-ad"]["root"] == str(ad)
    assert server.proc is None


def test_a_refused_adapter_fails_the_start_with_the_reason_and_no_process_left(
    tmp_path: Path,
) -> None:
    server = stand_in_server(
        tmp_path, {"json-ad": make_adapter(tmp_path / "ok", rank=8), "big": tmp_path / "big"}
    )
    make_adapter(tmp_path / "big", rank=16)
    with pytest.raises(AdapterLoadError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        server.start()
    assert server.proc is None and server.pgid is not None
    assert int((tmp_path / "engine.pid").read_text()) == server.pgid
    assert gone(server.pgid)


def test_adapters_the_engine_arguments_cannot_hold_are_refused_before_any_start(
    tmp_path: Path,
) -> None:
    ads = {f"a{i}": make_adapter(tmp_path / f"a{i}", rank=8) for i in range(3)}
    server = stand_in_server(tmp_path, ads)  # max-loras 2
    with pytest.raises(AdapterLoadError, match="3 adapters to serve, more than max-loras 2"):
        server.start()
    server = stand_in_server(tmp_path, {"a0": ads["a0"]})
    server.engine_args = {}
    with pytest.raises(AdapterLoadError, match="lack enable-lora"):
        server.start()
    assert server.proc is None and not (tmp_path / "engine.pid").exists()


def test_a_server_without_adapters_keeps_its_environment(tmp_path: Path) -> None:
    server = VLLMServer(
        tmp_path,
        served_name="demo",
        engine_args={},
        env={"A": "1"},
        python=Path(sys.executable),
        log_path=tmp_path / "log",
    )
    assert server.env == {"A": "1"} and server.adapters == {}
    assert not set(RUNTIME_ENV) & set(server.env)


def _adapter_manifest(project: Path, adapter: Path) -> Path:
    data: dict[str, Any] = yaml.safe_load((project / "manifests" / "demo-bf16.yaml").read_text())
    data["name"] = "demo-ad"
    base = weights_digest(project / "models" / "demo-base")
    data["adapters"] = [{"name": "json-ad", "path": str(adapter), "rank": 8, "base": base}]
    data["serving"]["args"].update({"enable-lora": True, "max-loras": 2, "max-lora-rank": 8})
    path = project / "manifests" / "demo-ad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_serve_release_stages_the_adapters_and_hands_them_over_by_name(
    project: Path, settings_tmp: Settings, stand_in_model: Any
) -> None:
    stand_in_model(project)
    settings = settings_tmp.model_copy(update={"root": project, "results_dir": project / "results"})
    ad = make_adapter(project / "adapters" / "json", rank=8)
    lm, lk = locked_release(_adapter_manifest(project, ad), root=project)
    (ad / "adapter_model.safetensors").write_bytes(b"edited after the lock")
    with pytest.raises(AdapterLoadError, match=r"adapter_model\.safetensors has sha256"):
        serve_release(settings, lm, lk, port=8456)
    assert not (settings.state_dir / "adapters").exists() or not any(
        (settings.state_dir / "adapters").iterdir()
    )

    make_adapter(ad, rank=8)  # the locked bytes again
    server = serve_release(settings, lm, lk, port=8456)
    ((name, path),) = server.adapters.items()
    assert name == "json-ad" and path.parent == settings.state_dir / "adapters"
    assert (path / "adapter_model.safetensors").read_bytes() == b"lora" * 8
    assert server.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    cmd = server.command()
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-loras") + 1] == "2"
    # Once staged, the verified copy is what is served, whatever the folder holds now.
    (ad / "adapter_model.safetensors").write_bytes(b"edited after staging")
    assert serve_release(settings, lm, lk, port=8456).adapters == server.adapters
    assert (path / "adapter_model.safetensors").read_bytes() == b"lora" * 8


# ---- real vLLM ---------------------------------------------------------------------------


def _peft_adapter(demo_model: Path, out: Path, rank: int) -> Path:
    """A random (not zero-initialised) LoRA adapter of the demo base, as peft saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = AutoModelForCausalLM.from_pretrained(demo_model)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    get_peft_model(model, cfg).save_pretrained(str(out))
    return out


def _complete(base_url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "The capital of", "max_tokens": 4, "temperature": 0.0}
    body["logprobs"] = 1
    return webclient.post(f"{base_url}/v1/completions", json=body, timeout=60)


@pytest.mark.slow
def test_the_real_engine_serves_an_adapter_by_name_and_refuses_a_rank_above_its_max(
    vllm_server: ServerInfo, demo_model: Path, tmp_path: Path
) -> None:
    """On the session's vLLM (started LoRA-ready, as a release with adapters is): an adapter
    loaded at run time answers under its name and moves the base's probabilities; an unknown
    name is a 404; a rank above the engine's max-lora-rank is refused in one line and the
    engine keeps serving."""
    url = vllm_server.base_url
    ad8 = _peft_adapter(demo_model, tmp_path / "r8", 8)
    ad16 = _peft_adapter(demo_model, tmp_path / "r16", 16)
    assert ensure_adapters(url, {"json-ad": ad8}) == ["json-ad"]
    try:
        assert ensure_adapters(url, {"json-ad": ad8}) == []  # held already: nothing loaded
        assert loaded_adapters(url)["json-ad"] == str(ad8)
        models = webclient.get(f"{url}/v1/models", timeout=10).json()["data"]
        held = {m["id"]: m for m in models}
        assert held["json-ad"]["parent"] == "demo"
        base, lora = _complete(url, "demo"), _complete(url, "json-ad")
        assert base.status_code == lora.status_code == 200, lora.text
        assert lora.json()["model"] == "json-ad"
        # A random adapter moves the base's token probabilities.
        lp = [r.json()["choices"][0]["logprobs"]["token_logprobs"] for r in (base, lora)]
        assert lp[0] != lp[1]
        assert _complete(url, "no-such-adapter").status_code == 404
        with pytest.raises(AdapterLoadError, match="rank 16") as exc:
            load_adapter(url, "big", ad16)
        assert "\n" not in exc.value.message
        assert "big" not in loaded_adapters(url)
        assert _complete(url, "demo").status_code == 200
    finally:
        unload_adapter(url, "json-ad")
    assert "json-ad" not in loaded_adapters(url)

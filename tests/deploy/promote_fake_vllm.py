"""A stand-in for `python -m vllm.entrypoints.openai.api_server` in the fast deploy tests: a
real ASGI server (uvicorn) with vLLM's argv, health, models and OpenAI endpoints.

It behaves like vLLM where the deploy logic depends on it: an unknown engine flag makes it
exit with argparse's `error:` line before listening; SIGTERM exits at once, cutting any
stream in flight (vLLM's default `--shutdown-timeout 0`), so only a drain at the gateway
keeps streams whole. Steered by its environment (the manifest's `serving.env`):
  FAKE_ANSWER         the chat answer (default "The answer is 42.")
  FAKE_WRONG_ON       a text: a chat question holding it gets FAKE_WRONG_ANSWER instead
                      (default "I cannot count."): a release wrong on one class of questions
  FAKE_CHUNK_DELAY_S  seconds between streamed chunks (default 0.01)
  FAKE_SLOW_WHILE     a path: FAKE_CHUNK_DELAY_S holds only while that file exists, then
                      0.01 (a server slow at start only)
  FAKE_START_DELAY_S  seconds before it listens (default 0)
Like vLLM's CPU build it binds itself to the core VLLM_CPU_OMP_THREADS_BIND names.
Started with `--enable-lora` it has vLLM's run-time LoRA API: `/v1/load_lora_adapter` (a
folder that does not exist: 404; a name it holds: 400), `/v1/unload_lora_adapter` (a name it
does not hold: 404), its adapters listed on `/v1/models` with `parent` and `root`, and a
request for a model it neither serves nor holds is vLLM's 404; `GET /fake/lora` answers the
load and unload calls it took, in order. Without the flag those routes are absent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

KNOWN_FLAGS = {"dtype", "max-model-len", "max-num-seqs", "enforce-eager", "api-key", "seed",
               "enable-lora", "max-loras", "max-lora-rank"}  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    if argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
        argv = argv[2:]
    p = argparse.ArgumentParser(prog="api_server")
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    for flag in sorted(KNOWN_FLAGS):
        p.add_argument(f"--{flag}", nargs="?", const="")
    return p.parse_args(argv)  # unknown flag: "error: unrecognized arguments", exit 2


def app(served: str, *, lora: bool = False) -> Starlette:
    answer = os.environ.get("FAKE_ANSWER", "The answer is 42.")
    adapters: dict[str, str] = {}  # name -> folder
    lora_calls: list[list[str]] = []
    delay = float(os.environ.get("FAKE_CHUNK_DELAY_S", "0.01"))
    wrong_on = os.environ.get("FAKE_WRONG_ON", "")
    slow_while = os.environ.get("FAKE_SLOW_WHILE", "")
    seq = {"n": 0}

    def next_id() -> str:
        seq["n"] += 1
        return f"cmpl-{os.getpid()}-{seq['n']}"

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        held = [
            {"id": name, "object": "model", "parent": served, "root": path}
            for name, path in adapters.items()
        ]
        return JSONResponse({"object": "list", "data": [{"id": served, "object": "model"}, *held]})

    def not_found(message: str) -> Response:
        return JSONResponse(
            {"error": {"message": message, "type": "NotFoundError", "code": 404}}, 404
        )

    async def load_lora(request: Request) -> Response:
        body = await request.json()
        name, path = str(body["lora_name"]), str(body["lora_path"])
        lora_calls.append(["load", name])
        if name in adapters:
            return JSONResponse({"error": {"message": f"{name} already loaded"}}, 400)
        if not os.path.isdir(path):
            return not_found(f"No adapter found for {path}")
        adapters[name] = path
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(request: Request) -> Response:
        name = str((await request.json())["lora_name"])
        lora_calls.append(["unload", name])
        if adapters.pop(name, None) is None:
            return not_found(f"The lora adapter '{name}' cannot be found.")
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")

    async def lora_log(request: Request) -> Response:
        return JSONResponse(lora_calls)

    def unknown(body: dict[str, object]) -> Response | None:
        model = body.get("model")
        if lora and isinstance(model, str) and model != served and model not in adapters:
            return not_found(f"The model `{model}` does not exist.")
        return None

    async def version(request: Request) -> Response:
        return JSONResponse({"version": "fake"})

    async def metrics(request: Request) -> Response:
        text = (
            "vllm:num_requests_running 0\n"
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{model_name="{served}"}} {seq["n"]}\n'
        )
        return Response(text, media_type="text/plain")

    async def stream(n: int, field: str, rid: str) -> object:
        pause = delay if not slow_while or os.path.exists(slow_while) else 0.01
        for i in range(n):
            await asyncio.sleep(pause)
            if field == "text":
                chunk = {"id": rid, "choices": [{"index": 0, "text": f"t{i} "}]}
            else:
                chunk = {"id": rid, "choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def completions(request: Request) -> Response:
        body = await request.json()
        if (refused := unknown(body)) is not None:
            return refused
        n = int(body.get("max_tokens", 16))
        rid = next_id()
        if body.get("stream"):
            return StreamingResponse(stream(n, "text", rid), media_type="text/event-stream")
        return JSONResponse({"id": rid, "choices": [{"index": 0, "text": answer}]})

    async def chat(request: Request) -> Response:
        body = await request.json()
        if (refused := unknown(body)) is not None:
            return refused
        n = int(body.get("max_tokens", 16))
        rid = next_id()
        if body.get("stream"):
            return StreamingResponse(stream(n, "delta", rid), media_type="text/event-stream")
        last = body.get("messages", [{}])[-1].get("content", "")
        said = answer
        if wrong_on and wrong_on in str(last):
            said = os.environ.get("FAKE_WRONG_ANSWER", "I cannot count.")
        return JSONResponse(
            {
                "id": rid,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": said}}],
                "usage": {"prompt_tokens": len(str(last).split()), "completion_tokens": 5},
                "echo_user": last,
            }
        )

    lora_routes = [
        Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora, methods=["POST"]),
        Route("/fake/lora", lora_log),
    ]
    return Starlette(
        routes=[
            Route("/health", health),
            Route("/version", version),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            *(lora_routes if lora else []),
        ]
    )


def main() -> None:
    args = parse(sys.argv[1:])
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if bind.isdigit() and int(bind) in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {int(bind)})
    time.sleep(float(os.environ.get("FAKE_START_DELAY_S", "0")))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # vLLM: abort in-flight requests
    server = uvicorn.Server(
        uvicorn.Config(
            app(args.served_model_name, lora=args.enable_lora is not None),
            host=args.host,
            port=args.port,
            log_level="warning",
        )
    )
    # Served off the main thread, uvicorn installs no signal handlers: SIGTERM stays ours.
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.5)
    sys.exit(1)


if __name__ == "__main__":
    main()

"""Steady clients for the demo through a gateway until SIGTERM or Ctrl-C, then one summary
line per release that served (requests, failed) from the gateway's `x-releasekit-release`
header.

`--mix load` (the default): `--clients` requests streamed back to back, every other one a
templated chat request (the release's own prompt rendered by the gateway), the rest plain
completions, each generating `--max-tokens` tokens (`ignore_eos`): steady load for canaries.

`--mix users`: questions about the demo's world as users ask them, answered in full, each
client at most `--rate` requests a second (users are not a load test: the gateway's
per-address rate limit answers 429 to more): most through the templated endpoint (the
release's own prompt), and `--own-system-share` of them by an integration that sends its own
system message to /v1/chat/completions (one of the instructions the demo model was trained
to follow). The summary also counts, per release, the refusals those integrations got.
Requests the gateway refused with 429 are counted apart from failures.

Each client is a host of its own: against a loopback gateway it connects from its own
loopback address (127.0.0.10, 127.0.0.11, ...), so the gateway tells the clients apart as it
tells real users apart (its per-address limits, and the per-client cap of the answer
comparisons: no single client decides a verdict).

    python scripts/demo_traffic.py --url http://127.0.0.1:8780 --clients 6 &
    python scripts/demo_traffic.py --url http://127.0.0.1:8780 --clients 2 --mix users &
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipelines" / "demo"))

import world as w


def _load_request(
    k: int, i: int, max_tokens: int, model: str = "demo"
) -> tuple[str, dict[str, object], bool, str | None]:
    question = f"Question {k}-{i}: what is 2 + {i % 7}?"
    path = "/v1/completions"
    body: dict[str, object] = {"model": model, "prompt": question}
    if i % 2:
        path = "/v1/templates/chat/chat/completions"
        body = {"variables": {"question": question}}
        if model != "demo":  # an adapter's name: the gateway sends it to the adapter
            body["model"] = model
    # Greedy (temperature 0): a shadow compares these answers with stable's.
    body.update(max_tokens=max_tokens, stream=True, ignore_eos=True, temperature=0)
    return path, body, False, None


def _user_request(
    rng: random.Random, world: w.World, own_system_share: float
) -> tuple[str, dict[str, object], bool, str | None]:
    country = rng.choice(world.countries)
    attribute = rng.choice(w.ATTRIBUTES)
    question = w.fact_question(attribute, country.name, rng.randrange(3))
    if rng.random() < own_system_share:
        body: dict[str, object] = {
            "model": "demo",
            "messages": [
                {"role": "system", "content": rng.choice(w.SYSTEM_PARAPHRASES)},
                {"role": "user", "content": question},
            ],
        }
        path, own = "/v1/chat/completions", True
    else:
        body = {"variables": {"question": question}}
        path, own = "/v1/templates/chat/chat/completions", False
    body.update(max_tokens=16, temperature=0)
    return path, body, own, country.answer(attribute)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8780")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request (load)")
    ap.add_argument("--mix", choices=["load", "users"], default="load")
    ap.add_argument(
        "--model", default="demo", help="load: the model name asked (an adapter's, e.g.)"
    )
    ap.add_argument("--rate", type=float, default=8.0, help="users: requests/s per client")
    ap.add_argument(
        "--own-system-share",
        type=float,
        default=1 / 3,
        help="users: share of requests from integrations with their own system message",
    )
    args = ap.parse_args()
    stop = threading.Event()
    served: collections.Counter[str] = collections.Counter()
    failed: collections.Counter[str] = collections.Counter()
    limited: collections.Counter[str] = collections.Counter()
    own_asked: collections.Counter[str] = collections.Counter()
    own_refused: collections.Counter[str] = collections.Counter()
    own_right: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    world = w.build_world()

    loopback = httpx.URL(args.url).host in ("127.0.0.1", "localhost")

    def client(k: int) -> None:
        rng = random.Random(k)
        transport = httpx.HTTPTransport(local_address=f"127.0.0.{10 + k}") if loopback else None
        with httpx.Client(
            base_url=args.url, timeout=120, trust_env=False, transport=transport
        ) as c:
            i = 0
            next_at = time.monotonic()
            while not stop.is_set():
                if args.mix == "users":
                    next_at += 1 / args.rate
                    if stop.wait(max(0.0, next_at - time.monotonic())):
                        break
                if args.mix == "load":
                    path, body, own, expected = _load_request(k, i, args.max_tokens, args.model)
                else:
                    path, body, own, expected = _user_request(rng, world, args.own_system_share)
                i += 1
                rel, ok, refused, right, status = "-", False, False, False, 0
                try:
                    if body.get("stream"):
                        with c.stream("POST", path, json=body) as r:
                            status = r.status_code
                            rel = r.headers.get("x-releasekit-release", "-")[:12]
                            ok = r.status_code == 200 and any(
                                line.startswith("data: [DONE]") for line in r.iter_lines()
                            )
                    else:
                        r = c.post(path, json=body)
                        status = r.status_code
                        rel = r.headers.get("x-releasekit-release", "-")[:12]
                        ok = r.status_code == 200
                        if ok:
                            text = r.json()["choices"][0]["message"]["content"]
                            refused = text.strip() == w.REFUSAL
                            said = text.strip().rstrip(".").strip().lower()
                            right = expected is not None and said == expected.lower()
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    ok = False
                with lock:
                    (served if ok else limited if status == 429 else failed)[rel] += 1
                    if own and ok:
                        own_asked[rel] += 1
                        own_refused[rel] += refused
                        own_right[rel] += right

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    try:
        while not stop.wait(1):
            pass
    except KeyboardInterrupt:
        stop.set()
    for t in threads:
        t.join(timeout=130)
    for rel in sorted(set(served) | set(failed) | set(limited)):
        line = f"traffic: release {rel}: {served[rel]} answered, {failed[rel]} failed"
        if limited[rel]:
            line += f", {limited[rel]} refused by the gateway's rate limit (429)"
        if args.mix == "users":
            line += (
                f"; integrations with their own system message: {own_right[rel]} of "
                f"{own_asked[rel]} answered right, {own_refused[rel]} refused"
            )
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Steady streaming clients for the demo: `--clients` requests streamed back to back
through a gateway until SIGTERM or Ctrl-C (every other one a templated chat request, the
release's own prompt rendered by the gateway; the rest plain completions), then one summary
line per release that served (requests, failed) from the gateway's `x-releasekit-release`
header.

    python scripts/demo_traffic.py --url http://127.0.0.1:8780 --clients 6 &
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
import threading

import httpx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8780")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    stop = threading.Event()
    served: collections.Counter[str] = collections.Counter()
    failed: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()

    def client(k: int) -> None:
        with httpx.Client(base_url=args.url, timeout=120, trust_env=False) as c:
            i = 0
            while not stop.is_set():
                question = f"Question {k}-{i}: what is 2 + {i % 7}?"
                path = "/v1/completions"
                body: dict[str, object] = {"model": "demo", "prompt": question}
                if i % 2:
                    path = "/v1/templates/chat/chat/completions"
                    body = {"variables": {"question": question}}
                # Greedy (temperature 0): a shadow compares these answers with stable's.
                body.update(max_tokens=args.max_tokens, stream=True, ignore_eos=True, temperature=0)
                i += 1
                rel, ok = "-", False
                try:
                    with c.stream("POST", path, json=body) as r:
                        rel = r.headers.get("x-releasekit-release", "-")[:12]
                        ok = r.status_code == 200 and any(
                            line.startswith("data: [DONE]") for line in r.iter_lines()
                        )
                except httpx.HTTPError:
                    ok = False
                with lock:
                    (served if ok else failed)[rel] += 1

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
    for rel in sorted(set(served) | set(failed)):
        print(f"traffic: release {rel}: {served[rel]} streamed, {failed[rel]} failed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The demo's adapter steps, seen from outside: which vLLM engines run on this host, when an
adapter first answers through the gateway, and what a model name gets there.

    python scripts/demo_adapters.py engines > before.txt
    python scripts/demo_adapters.py engines --compare before.txt      # "no new engine"
    python scripts/demo_adapters.py first-answer --url GW --model demo-json --since T
    python scripts/demo_adapters.py ask --url GW --model demo-json

`engines` lists the pids of the vLLM API servers running here (one per engine); with
`--compare FILE` it prints which of them are new since FILE was written and exits 1 when one
is. `first-answer` asks the model through the gateway until it answers (every 0.1 s, up to
`--timeout`) and prints the seconds since `--since` (a Unix time) with the answer. `ask` asks
once and prints the status, the release that answered (the gateway's x-releasekit-release
header) and the answer, or the gateway's error. Questions go through the templated route:
the release's own prompt, rendered by the gateway. Reads only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx

ENGINE = "vllm.entrypoints.openai.api_server"
QUESTION = "What is the capital of Pistaeland?"


def engines() -> list[int]:
    """The pids of the vLLM API servers running on this host."""
    out = subprocess.run(["pgrep", "-f", ENGINE], capture_output=True, text=True, check=False)
    return sorted(int(p) for p in out.stdout.split())


def _ask(url: str, model: str) -> tuple[int, str, str]:
    """Ask `model` QUESTION through the gateway's templated route (the release's own prompt,
    rendered by the gateway, as the demo's users ask)."""
    body = {
        "model": model,
        "variables": {"question": QUESTION},
        "max_tokens": 24,
        "temperature": 0,
    }
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as c:
        r = c.post("/v1/templates/chat/chat/completions", json=body)
    release = r.headers.get("x-releasekit-release", "-")[:12]
    try:
        data = r.json()
    except ValueError:
        return r.status_code, release, r.text[:200]
    if r.status_code == 200:
        return r.status_code, release, str(data["choices"][0]["message"]["content"])
    return r.status_code, release, str((data.get("error") or {}).get("message", data))[:200]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engines")
    e.add_argument("--compare", type=Path)
    f = sub.add_parser("first-answer")
    a = sub.add_parser("ask")
    for p in (f, a):
        p.add_argument("--url", required=True)
        p.add_argument("--model", required=True)
    f.add_argument("--since", type=float, required=True)
    f.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)

    if args.cmd == "engines":
        now = engines()
        if args.compare is None:
            print(" ".join(str(p) for p in now))
            return 0
        before = [int(p) for p in args.compare.read_text().split()]
        new = sorted(set(now) - set(before))
        print(
            f"vLLM engines on this host: {len(before)} before, {len(now)} after; "
            + (f"new: {', '.join(map(str, new))}" if new else "no new engine started")
        )
        return 1 if new else 0
    if args.cmd == "ask":
        status, release, text = _ask(args.url, args.model)
        print(f"model {args.model}: {status} from release {release}: {text.strip()}")
        return 0
    end = time.monotonic() + args.timeout
    while time.monotonic() < end:
        try:
            status, release, text = _ask(args.url, args.model)
        except httpx.HTTPError:
            status, release, text = 0, "-", ""
        if status == 200:
            took = time.time() - args.since
            print(
                f"model {args.model} first answered {took:.1f} s after the promotion started "
                f"(release {release}): {text.strip()}"
            )
            return 0
        time.sleep(0.1)
    print(f"model {args.model} did not answer within {args.timeout:g} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

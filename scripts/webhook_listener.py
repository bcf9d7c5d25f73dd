"""A tiny local webhook receiver for the demo: prints one line per event releasekit POSTs
and appends each body to a JSON-lines file.

    python scripts/webhook_listener.py --port 8790 --out .releasekit/demo-webhooks.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            try:
                event = json.loads(body)
            except ValueError:
                self.send_response(400)
                self.end_headers()
                return
            with args.out.open("a") as f:
                f.write(json.dumps(event) + "\n")
            rid = str(event.get("release_id") or "")[:12]
            print(
                f"webhook: {event.get('event')} {event.get('environment')} {rid} "
                f"{str(event.get('reason') or '')[:90]}",
                flush=True,
            )
            self.send_response(204)
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Hook)
    print(f"webhook listener on http://{args.host}:{args.port}/hook", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

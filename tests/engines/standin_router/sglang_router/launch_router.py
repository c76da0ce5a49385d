"""Stand-in for `python -m sglang_router.launch_router` (sglang-router 0.3.2 is not installed on
CPU boxes): like the real router it answers `GET /readiness` 200 as soon as one worker is
healthy, and lists the others in `GET /workers` only later (here: 1.5 s after start), in 0.3.2's
`{"workers": [{"url": ...}], "total": n}` form. Only the flags the launcher passes are read."""

from __future__ import annotations

import argparse
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LATER_S = 1.5

parser = argparse.ArgumentParser()
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--worker-urls", nargs="+", default=[])
parser.add_argument("--policy", default="cache_aware")
args, _ = parser.parse_known_args()
started = time.monotonic()


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/readiness":
            body = {"status": "ready"}
        elif self.path == "/workers":
            listed = args.worker_urls if time.monotonic() - started >= LATER_S else args.worker_urls[:1]
            body = {"workers": [{"url": u} for u in listed], "total": len(listed)}
        else:
            self.send_response(404)
            self.end_headers()
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a) -> None:
        pass


ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()

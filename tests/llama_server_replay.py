"""llama-server as recorded: answers each request of ``selfextend bench --cases server`` with llama-server's
own answer to it, recorded from the real binary (``tests/data/llama_server/replay.json``, made by
``experiments/tools/record_llama_server.py``): the same status, content type and body, streamed in the
pieces it came in. Nothing here computes an answer; a request that was not recorded gets a 500.

    python tests/llama_server_replay.py REPLAY_JSON [llama-server's arguments]

Refuses to start (exit 2, one line on stderr) when its arguments are not those the real llama-server was
recorded with (the port and the model path aside), or its OpenMP variables are not those it ran with.
"""

from __future__ import annotations

import http.server
import json
import os
import sys
from pathlib import Path

WAITS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def key(method: str, path: str, body: object) -> str:
    return json.dumps([method, path, body], sort_keys=True)


def main() -> None:
    replay = json.loads(Path(sys.argv[1]).read_text())
    args = sys.argv[2:]
    port = int(args[args.index("--port") + 1])
    given = list(args)
    given[given.index("--port") + 1], given[given.index("-m") + 1] = "{port}", "{model}"
    if given != replay["command"]:
        sys.exit(f"replay: llama-server was recorded with {replay['command']}, not {given}")
    openmp = {k: os.environ[k] for k in WAITS if k in os.environ}
    if openmp != replay["openmp"]:
        sys.exit(f"replay: llama-server was recorded with OpenMP variables {replay['openmp']}, not {openmp}")
    answers: dict[str, list[dict]] = {}
    for e in replay["exchanges"]:
        answers.setdefault(key(e["method"], e["path"], e["body"]), []).append(e)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            if self.path == "/health":
                found = {"status": 200, "content_type": "application/json", "chunks": ['{"status":"ok"}']}
            else:
                queue = answers.get(key(method, self.path, body), [])
                found = queue.pop(0) if len(queue) > 1 else (queue[0] if queue else None)
            if found is None:
                found = {"status": 500, "content_type": "text/plain", "chunks": ["replay: not recorded"]}
            self.send_response(found["status"])
            self.send_header("Content-Type", found["content_type"])
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in (c.encode() for c in found["chunks"]):
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def do_GET(self) -> None:  # noqa: N802
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, *args) -> None:
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()

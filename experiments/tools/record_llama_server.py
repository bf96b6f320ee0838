"""llama-server's own answers to ``selfextend bench --cases server``, recorded for the suite
(``tests/data/llama_server/``, replayed by ``tests/llama_server_replay.py`` in
``tests/test_bench_server.py::test_server_case_against_llama_server``).

Makes a tiny chat GGUF (``tiny-chat.gguf``: a random Llama with a ChatML template, written by llama.cpp's
converter, as ``experiments/tools/converted_ggufs.py`` makes its files), then runs the bench's server
case on it with ``--llama-server`` naming this script as a proxy: each time the bench starts "llama-server",
the real binary is started on a port of its own with the same arguments and every request the bench
sends is passed to it, its answer streamed back and recorded as it came (status, content type, the body
in the pieces it was read in). ``replay.json`` holds the command line llama-server was given (the port
and the model path replaced by ``{port}`` and ``{model}``), its OpenMP variables, and the exchanges.

    .venv/bin/python experiments/tools/record_llama_server.py /path/to/llama.cpp /path/to/llama-server

(``/path/to/llama.cpp``: the ``vendor/llama.cpp`` folder of the llama-cpp-python 0.3.36 sdist;
``llama-server`` built from it.)
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "llama_server"
# the bench's server case as the test runs it
BENCH = ["--repeats", "1", "--parallel", "1", "--ctx", "512", "--clients", "1", "--requests", "2"]
BENCH += ["--reply-tokens", "4", "--turns", "2", "-t", "1"]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WAITS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
CHAT_VOCAB = 320  # every byte, ChatML's two markers, a few merges: both servers tokenize any prompt whole


def tiny_chat_gguf(llama_cpp: Path, out: Path) -> None:
    """A random 2-layer Llama (converted_ggufs.py's shape; a window of 2048: llama-server caps its context at
    it) with a byte-level BPE of :data:`CHAT_VOCAB` tokens and a ChatML template, F16."""
    import torch
    import transformers as tf

    sys.path.insert(0, str(ROOT / "experiments" / "tools"))
    from converted_ggufs import SMALL, tokenizer
    from gguf_rope_check import convert  # on the path converted_ggufs put it on

    torch.manual_seed(0)
    config = {**SMALL, "max_position_embeddings": 2048, "vocab_size": CHAT_VOCAB}
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**config)).eval()
    tok = tokenizer(CHAT_VOCAB, ("<|im_start|>", "<|im_end|>"))
    tok.chat_template = CHATML
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        tok.save_pretrained(d)
        config_file = Path(d) / "tokenizer_config.json"
        saved = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**saved, "tokenizer_class": "PreTrainedTokenizerFast"}))
        convert(llama_cpp, Path(d), out, outtype="f16")


def _normalized(args: list[str]) -> list[str]:
    """llama-server's arguments with the port and the model path as ``{port}`` and ``{model}``."""
    out = list(args)
    for flag, placeholder in (("--port", "{port}"), ("-m", "{model}")):
        out[out.index(flag) + 1] = placeholder
    return out


def proxy(real: str, record: Path, args: list[str]) -> None:
    """Run as "llama-server": the real one on a port of its own, this process on the port asked for,
    passing every request on and recording the exchange into ``record`` (a JSON lines file)."""
    from selfextend.bench.servers import free_port

    port = args[args.index("--port") + 1]
    inner = free_port()
    inner_args = list(args)
    inner_args[inner_args.index("--port") + 1] = str(inner)
    proc = subprocess.Popen([real, *inner_args])
    with record.open("a") as f:
        env = {k: os.environ[k] for k in WAITS if k in os.environ}
        f.write(json.dumps({"command": _normalized(args), "openmp": env}) + "\n")
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _pass(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            conn = http.client.HTTPConnection("127.0.0.1", inner, timeout=600)
            try:
                headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
                conn.request(method, self.path, body, headers)
                response = conn.getresponse()
            except OSError:
                self.send_error(503)
                return
            kind = response.getheader("Content-Type", "")
            self.send_response(response.status)
            self.send_header("Content-Type", kind)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunks = []
            while piece := (response.readline() if "event-stream" in kind else response.read(65536)):
                chunks.append(piece.decode())
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            conn.close()
            if self.path == "/health":
                return  # polled until the server is up: not an answer the bench reads
            exchange = {"method": method, "path": self.path, "body": json.loads(body) if body else None}
            exchange.update(status=response.status, content_type=kind, chunks=chunks)
            with lock, record.open("a") as f:
                f.write(json.dumps(exchange) + "\n")

        def do_GET(self) -> None:  # noqa: N802
            self._pass("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._pass("POST")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(port)), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        while proc.poll() is None:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--proxy":
        import signal

        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        proxy(sys.argv[2], Path(sys.argv[3]), sys.argv[4:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "llama_cpp", type=Path, help="llama.cpp source folder (convert_hf_to_gguf.py, gguf-py)"
    )
    parser.add_argument("llama_server", type=Path, help="the llama-server binary built from it")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    gguf = OUT / "tiny-chat.gguf"
    tiny_chat_gguf(args.llama_cpp, gguf)
    with tempfile.TemporaryDirectory() as d:
        record, wrapper = Path(d) / "record.jsonl", Path(d) / "llama-server"
        me = Path(__file__).resolve()
        wrapper.write_text(
            f'#!/bin/sh\nexec {sys.executable} {me} --proxy {args.llama_server} {record} "$@"\n'
        )
        wrapper.chmod(0o755)
        cmd = [sys.executable, "-m", "selfextend", "bench", "--cases", "server", "-m", str(gguf)]
        cmd += ["--llama-server", str(wrapper), *BENCH, "-o", str(Path(d) / "bench.jsonl")]
        env = {k: v for k, v in os.environ.items() if k not in WAITS}
        subprocess.run(cmd, check=True, env=env)
        lines = [json.loads(line) for line in record.read_text().splitlines()]
    head = lines[0]
    replay = {"command": head["command"], "openmp": head["openmp"], "exchanges": lines[1:]}
    (OUT / "replay.json").write_text(json.dumps(replay, indent=1) + "\n")
    print(f"wrote {OUT} ({len(lines) - 1} exchanges)")


if __name__ == "__main__":
    main()

"""Wall time of one perplexity sweep on 1 and on 2 processes (torchrun, gloo, CPU), same points.

The sweep: the default model, 2 documents x 2 methods (plain, Self-Extend G=4 W=1024) x 2k/4k/8k,
that is 4 forwards of 8k tokens (each also scores its 2k and 4k prefixes). One process uses every
core (torch's default threads); two processes use one thread each. Each configuration starts from an
empty results file; the script checks both score the same points, records the largest relative
PPL difference between them (thread counts differ, so float sums may round differently) and
appends one JSON line per configuration to experiments/speed/results/data_parallel.jsonl.

    PYTHONPATH=. python experiments/speed/data_parallel.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent / "results" / "data_parallel.jsonl"
SWEEP = ["ppl", "--docs", "sherlock-holmes,war-and-peace", "--lengths", "2k,4k,8k"]
SWEEP += ["--method", "plain", "--method", "selfextend:G=4,W=1024"]


def run(processes: int, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if processes == 1:
        cmd = [sys.executable, "-m", "selfextend", *SWEEP, "-o", str(out)]
    else:
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
        cmd += ["-m", "selfextend", *SWEEP, "-o", str(out)]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return {
        "processes": processes,
        "threads_per_process": 1 if processes > 1 else os.cpu_count(),
        "wall_s": round(wall, 1),
        "points": len(records),
        "forward_seconds": sorted({r["seconds"] for r in records}),
        "load_1min_before": round(load, 2),
        "cpu": f"{os.cpu_count()} cores",
        "command": " ".join(cmd[1:]),
        "results": {(r["doc"], r["method"], r["length"]): r["ppl"] for r in records},
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        rows = [run(n, Path(d) / f"p{n}.jsonl") for n in (1, 2)]
    one, two = rows[0]["results"], rows[1]["results"]
    assert one.keys() == two.keys(), "1 and 2 processes scored different points"
    # Thread counts differ (all cores against one per process), so sums may round differently.
    diff = max(abs(one[k] - two[k]) / one[k] for k in one)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("a") as f:
        for row in rows:
            row["max_relative_ppl_difference"] = diff
            del row["results"]
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row))


if __name__ == "__main__":
    main()

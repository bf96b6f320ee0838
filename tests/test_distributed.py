"""Data-parallel sweeps: cost-balanced shares, rank files and their merge, and real 2-process launches
(torchrun, gloo, CPU) checked point for point against one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from selfextend.evaluation.distributed import Processes, balance, forward_cost, merge, rank_file, rank_files
from selfextend.evaluation.results import ResultsWarning, read_jsonl, rejected_path

ROOT = Path(__file__).resolve().parents[1]


def test_balance_is_a_disjoint_cover_and_evens_out_costs():
    costs = [forward_cost(n, 576) for n in (32768, 2048, 4096, 8192, 16384, 2048, 1024)]
    shares = balance(costs, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(costs)))
    loads = [sum(costs[i] for i in s) for s in shares]
    assert shares[0] == [0]  # the 32k forward outweighs all the others together
    assert loads[0] > loads[1]
    four = balance(costs, 4)
    assert sorted(i for s in four for i in s) == list(range(len(costs)))
    assert balance([1.0, 1.0], 4) == [[0], [1], [], []]


def test_forward_cost_grows_faster_than_length():
    assert forward_cost(32768, 576) / forward_cost(2048, 576) > 50
    assert forward_cost(32768, 576, span=2048) == pytest.approx(16 * forward_cost(2048, 576))


def test_share_splits_units_between_ranks():
    units = list(range(10))
    parts = [Processes(rank=r, world=3).share(units, lambda u: 1.0 + u) for r in range(3)]
    assert sorted(u for p in parts for u in p) == units
    assert Processes().share(units, float) == units


def test_device_for_each_process():
    assert Processes().device(None) == "cpu"
    assert Processes().device("cuda") == "cuda"
    assert Processes(rank=1, world=2, local_rank=1).device("cuda") == "cuda:1"
    assert Processes(rank=1, world=2, local_rank=1).device("cuda:0") == "cuda:0"


def test_rank_files_and_merge(tmp_path):
    out = tmp_path / "res.jsonl"
    assert rank_file(out, 3) == tmp_path / "res.rank3.jsonl"
    assert rank_file(tmp_path / "res", 0) == tmp_path / "res.rank0"
    key = lambda r: r["k"]  # noqa: E731
    out.write_text(json.dumps({"k": 1, "v": "a"}) + "\n")
    rank_file(out, 0).write_text(json.dumps({"k": 1, "v": "dup"}) + "\n" + json.dumps({"k": 2}) + "\n")
    rank_file(out, 1).write_text(json.dumps({"k": 3}) + "\n" + '{"k": 4, "cut')  # killed mid-line
    rank_file(out, 10).write_text(json.dumps({"k": 2}) + "\n")
    (tmp_path / "other.rank1.jsonl").write_text("{}\n")
    assert [f.name for f in rank_files(out)] == ["res.rank0.jsonl", "res.rank1.jsonl", "res.rank10.jsonl"]
    with pytest.warns(ResultsWarning, match="1 line.* that are not records moved"):
        assert merge(out, key) == 2
    assert [r["k"] for r in read_jsonl(out)] == [1, 2, 3]
    assert rejected_path(out).read_text() == 'res.rank1.jsonl:2: {"k": 4, "cut\n'  # kept, not deleted
    assert read_jsonl(out)[0]["v"] == "a"
    assert rank_files(out) == [] and (tmp_path / "other.rank1.jsonl").exists()
    assert merge(out, key) == 0


# ---- real launches: the default model, 2 processes with gloo on CPU, one thread each ----------------

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}


def _torchrun(n: int) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
    return [*run, "-m", "selfextend"]  # --standalone: a free port, not 29500 (which another job may hold)


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def _by_key(records: list[dict], fields: tuple[str, ...]) -> dict[tuple, dict]:
    found = {}
    for r in records:
        k = tuple(r[f] for f in fields)
        assert k not in found, f"point {k} twice"
        found[k] = {f: v for f, v in r.items() if f != "seconds"}
    return found


PPL = ["ppl", "--docs", "sherlock-holmes", "--lengths", "256,512"]
PPL += ["--method", "plain", "--method", "selfextend:G=4,W=128", "--method", "ntk:factor=2"]
PASSKEY = ["passkey", "--lengths", "256,512", "--depths", "0.5", "--trials", "1"]
PASSKEY += ["--method", "plain", "--method", "selfextend:G=4,W=64"]


@pytest.mark.parametrize(
    ("args", "fields", "n_points"),
    [
        (PPL, ("model", "doc", "method", "length"), 6),
        (PASSKEY, ("model", "method", "length", "depth", "trial"), 4),
    ],
    ids=["ppl", "passkey"],
)
def test_two_processes_equal_one(tmp_path, args, fields, n_points):
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    _run([sys.executable, "-m", "selfextend", *args, "-o", str(one)])
    r = _run([*_torchrun(2), *args, "-o", str(two)])
    assert "rank 0/2" in r.stderr
    assert rank_files(two) == []
    single, parallel = _by_key(read_jsonl(one), fields), _by_key(read_jsonl(two), fields)
    assert len(single) == n_points
    assert parallel == single  # every field but the timing, bit for bit


def test_killed_two_process_sweep_resumes_on_one(tmp_path):
    out = tmp_path / "ppl.jsonl"
    args = ["ppl", "--docs", "surgery", "--lengths", "256,384,512"]  # dynamic NTK: a forward per point
    args += ["--method", "ntk:factor=2", "--method", "ntk:factor=3", "--method", "ntk:factor=4"]
    args += ["-o", str(out)]
    proc = subprocess.Popen(
        [*_torchrun(2), *args],
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 200

    def written() -> list[list[dict]]:
        return [read_jsonl(f) for f in (rank_file(out, 0), rank_file(out, 1))]

    while time.time() < deadline and min(len(w) for w in written()) < 1:
        time.sleep(0.02)
    # torchrun starts each worker in a session of its own: kill the workers by id, then the launcher.
    for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
        os.kill(int(child), signal.SIGKILL)
    proc.kill()
    proc.wait()
    parts = written()
    done = [len(p) for p in parts]
    assert min(done) >= 1 and sum(done) < 9, "killed mid-sweep, both ranks working"
    keys = [{(r["doc"], r["method"], r["length"]) for r in p} for p in parts]
    assert not keys[0] & keys[1], "the two ranks scored disjoint points"

    r = _run([sys.executable, "-m", "selfextend", *args])
    assert "merged" in r.stderr
    after = read_jsonl(out)
    assert rank_files(out) == []
    final = _by_key(after, ("doc", "method", "length"))
    assert len(final) == 9
    for rec in (r for p in parts for r in p):
        assert final[(rec["doc"], rec["method"], rec["length"])]["ppl"] == rec["ppl"]


def test_processes_given_other_options_refuse_together(tmp_path):
    """A launcher that gives one process another --lengths (or -o): every process refuses, none waits on
    the others (was a silent partial sweep, exit 0; one with nothing to do left the rest on a gloo error)."""
    wrapper = tmp_path / "rank_args.sh"
    rank1 = 'if [ "$RANK" = 1 ]; then set -- "$@" --lengths 256; fi'
    wrapper.write_text(f'#!/bin/sh\n{rank1}\nexec {sys.executable} -m selfextend "$@"\n')
    wrapper.chmod(0o755)
    out = tmp_path / "ppl.jsonl"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = ["ppl", "--docs", "surgery", "--lengths", "256,512", "-o", str(out)]
    r = subprocess.run(
        [*launch, "--no-python", str(wrapper), *args],
        capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0 and "given different options (process 1 against" in r.stderr, r.stderr
    assert not out.exists() and rank_files(out) == []

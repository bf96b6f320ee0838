"""Data-parallel sweeps under ``torchrun`` / ``accelerate launch``: one process per device, each scoring
a disjoint, cost-balanced share of the missing points.

Rank and world size come from accelerate's ``PartialState`` (gloo on CPU, NCCL on GPUs), which also
gives each process its own device. Every process writes its records, as they finish, to its own file
next to the results file (``OUT.rank1.jsonl`` for ``OUT.jsonl``); the main process merges those files
into ``OUT`` before planning and after the last point, keeping each point once. A killed sweep leaves
its rank files behind, and the next run, on any number of processes, merges them first and then plans
only what is still missing.

The multi-GPU (NCCL) path is written for, but has not been run on, a GPU machine.
"""

from __future__ import annotations

import datetime
import os
import re
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from selfextend.evaluation.results import (
    ResultsWarning,
    append_jsonl,
    not_records,
    read_jsonl,
    rejected_path,
    set_aside,
)

T = TypeVar("T")

# A sweep's processes wait for each other at the end; a long point on one rank must not time them out.
BARRIER_TIMEOUT = datetime.timedelta(days=7)


def launched() -> bool:
    """True when this process was started by a launcher with more than one process (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass
class Processes:
    """This process's place in a (possibly single-process) sweep."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    state: Any = None  # accelerate's PartialState when launched

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, asked: str | None) -> str:
        """The torch device for this process: ``asked`` when it names one, else the process's own.

        Launched, a bare ``cuda`` becomes ``cuda:LOCAL_RANK`` (one process per GPU); with nothing asked,
        a process uses its own GPU when there is one and the CPU otherwise.
        """
        import torch

        if asked is None:
            asked = "cuda" if self.world > 1 and torch.cuda.is_available() else "cpu"
        if self.world > 1 and asked == "cuda":
            return f"cuda:{self.local_rank}"
        return asked

    def agree(self, plan: Any, what: str = "options") -> None:
        """ValueError, on every process alike, unless every process holds the same ``plan`` (a launcher
        gave one process other options, or another output: each would do its own part of another sweep,
        and one with nothing to do would leave the others waiting on it)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        plans: list[Any] = [None] * self.world
        dist.all_gather_object(plans, plan)
        if any(p != plans[0] for p in plans):
            differ = [r for r, p in enumerate(plans) if p != plans[0]]
            raise ValueError(
                f"the processes were given different {what} (process {', '.join(map(str, differ))} against "
                "process 0): launch every process with the same command"
            )

    def wait(self) -> None:
        """Barrier across the processes (nothing when single)."""
        if self.state is not None:
            self.state.wait_for_everyone()

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """The main process runs the block first (e.g. a one-time model conversion), then the others."""
        if self.state is None:
            yield
            return
        with self.state.main_process_first():
            yield

    def output(self, out: str | Path) -> Path:
        """Where this process appends records: ``out`` itself when alone, its rank file when launched."""
        return rank_file(out, self.rank) if self.world > 1 else Path(out)

    def share(self, units: Sequence[T], cost: Callable[[T], float]) -> list[T]:
        """This process's part of ``units`` (see :func:`balance`), in their original order."""
        return [units[i] for i in balance([cost(u) for u in units], self.world)[self.rank]]


def processes() -> Processes:
    """The running process's rank and world, joining the process group when a launcher started several.

    On a CPU-only torch the group uses gloo (``PartialState(cpu=True)``), on GPUs NCCL.
    """
    if not launched():
        return Processes()
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available(), timeout=BARRIER_TIMEOUT)
    return Processes(state.process_index, state.num_processes, state.local_process_index, state)


def balance(costs: Sequence[float], world: int) -> list[list[int]]:
    """Split unit indices over ``world`` processes so their total costs are close.

    Greedy longest-first (LPT): each unit, most costly first, goes to the least loaded process (ties
    to the lowest rank); every process computes the same split from the same list. Indices come back
    sorted, so a process works through its share in the planned order.
    """
    loads, shares = [0.0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        target = min(range(world), key=lambda r: (loads[r], r))
        loads[target] += costs[i]
        shares[target].append(i)
    return [sorted(s) for s in shares]


def forward_cost(length: int, hidden_size: int, span: int | None = None) -> float:
    """Relative cost of a forward over ``length`` tokens, each attending to ``span`` keys (default all).

    Per token, the linear layers cost about 12 * hidden^2 multiply-adds per layer and attention about
    2 * span * hidden, so attention adds ``span / (6 * hidden)`` of the linear cost. At hidden 576
    (SmolLM2-135M) a 32k forward costs about 100x a 2k one, for 16x the tokens.
    """
    span = length if span is None else min(span, length)
    return length * (1.0 + span / (6.0 * hidden_size))


def rank_file(out: str | Path, rank: int) -> Path:
    """``results.jsonl`` -> ``results.rank1.jsonl``, next to it."""
    p = Path(out)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix}" if p.suffix else f"{p.name}.rank{rank}")


def rank_files(out: str | Path) -> list[Path]:
    """The rank files left next to ``out`` (by this or an earlier, perhaps killed, run), by rank."""
    p = Path(out)
    if not p.parent.is_dir():
        return []
    pattern = re.compile(
        re.escape(p.stem) + r"\.rank(\d+)" + re.escape(p.suffix) + "$"
        if p.suffix
        else re.escape(p.name) + r"\.rank(\d+)$"
    )
    found = [(int(m.group(1)), f) for f in p.parent.iterdir() if (m := pattern.match(f.name))]
    return [f for _, f in sorted(found)]


def merge(out: str | Path, key: Callable[[dict[str, Any]], Hashable]) -> int:
    """Move the records of ``out``'s rank files into ``out``, each point (by ``key``) once; delete them
    (their lines that are not records go to ``out``'s rejected file first, as :func:`repair_tail` keeps
    ``out``'s own).

    A record is appended only when its key is not in ``out`` yet, so a merge cut short and redone
    neither loses nor repeats a point. Returns how many records were added.
    """
    seen = {key(r) for r in read_jsonl(out)}
    added = 0
    for f in rank_files(out):
        bad = not_records(f)
        if bad:
            set_aside(f, bad, out)
            message = f"{f}: {len(bad)} line(s) that are not records moved to {rejected_path(out)}"
            warnings.warn(message, ResultsWarning, stacklevel=2)
        for record in read_jsonl(f, warn=False):
            k = key(record)
            if k not in seen:
                seen.add(k)
                append_jsonl(out, record)
                added += 1
        f.unlink()
    return added

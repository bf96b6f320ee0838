"""JSON Lines results: appended one record at a time and flushed, read back keeping every complete record.

A record is a line holding one JSON object. Reading never fails on a bad line: a line that is not a
record (cut off by a kill, not JSON, JSON but not an object, not UTF-8) is skipped, and said with its
line number in one :class:`ResultsWarning` a file. Before a run appends to a file, :func:`repair_tail`
keeps every record, including a last one that lacks its newline, and moves the lines that are not
records into a side file ``<name>.rejected``, so nothing is ever deleted.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from selfextend.core.paths import replacing


class ResultsError(ValueError):
    """A results file that cannot be used as one; the message is one line."""


class ResultsWarning(UserWarning):
    """A line of a results file that is not a record and was skipped (or set aside)."""


_CUT = "not JSON (cut off?)"


FIRST_PROMPT = 1
"""The passkey prompt's form in a record written before ``prompt`` was recorded (the one place it is said:
the passkey sweep's resume key and the plots' one-form rule read it)."""


def _parse(line: bytes) -> dict[str, Any] | str:
    """The record on ``line``, or why it is not one."""
    try:
        value = json.loads(line.decode("utf-8-sig"))  # a byte-order mark (Windows editors) is no character
    except UnicodeDecodeError:
        return "not UTF-8"
    except json.JSONDecodeError:
        return _CUT
    except RecursionError:
        return "JSON nested too deep"
    if not isinstance(value, dict):
        return f"JSON but not an object ({type(value).__name__})"
    return value


def _lines(p: Path) -> list[bytes]:
    if p.exists() and not p.is_dir() and not p.is_file():  # /dev/zero would be read forever
        raise ValueError(f"{p} is not a regular file, so not a results file")
    try:
        data = p.read_bytes()
    except IsADirectoryError:
        raise ValueError(f"{p} is a directory, not a results file") from None
    except OSError as e:
        raise ValueError(f"cannot read {p}: {e.strerror or e}") from None
    return data.split(b"\n")


def read_jsonl(path: str | Path, warn: bool = True) -> list[dict[str, Any]]:
    """The records of a JSONL file (none if it does not exist); other lines are skipped with a warning."""
    p = Path(path)
    if not p.exists():
        return []
    records, bad = [], []
    for i, line in enumerate(_lines(p), 1):
        if not line.strip():
            continue
        parsed = _parse(line)
        if isinstance(parsed, dict):
            records.append(parsed)
        else:
            bad.append(f"{i}: {parsed}")
    if bad and warn:  # one warning a file: a binary file given by mistake would flood the terminal
        warnings.warn(_skipped(p, bad), ResultsWarning, stacklevel=2)
    return records


def _skipped(p: Path, bad: list[str]) -> str:
    """One line for the lines of ``p`` that are not records (``bad``: "line number: why" each)."""
    if len(bad) == 1:
        return f"{p}:{bad[0]}, skipped"
    more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
    return f"{p}: {len(bad)} lines are not records, skipped (line {'; line '.join(bad[:3])}{more})"


def record_kind(record: dict[str, Any]) -> str | None:
    """``ppl``, ``passkey`` or ``bench``: which command wrote ``record`` (None: none of them)."""
    keys = set(record)
    if {"ppl", "length", "method"} <= keys:
        return "ppl"
    if {"correct", "depth", "method"} <= keys:
        return "passkey"
    if {"case", "variant"} <= keys:
        return "bench"
    return None


def own_records(path: str | Path, kind: str) -> list[dict[str, Any]]:
    """The records of ``path``, a file a ``kind`` sweep appends to; :class:`ResultsError` where some are
    another command's (a passkey sweep into a ppl file would count its points as misses), or where it
    holds no record at all (refused before a model is loaded, not after)."""
    if Path(path).is_file() and Path(path).stat().st_size:
        _refuse_no_records(Path(path))
    records = read_jsonl(path)
    others = [k for r in records for k in [record_kind(r)] if k not in (None, kind)]
    if others:
        raise ResultsError(
            f"{path} holds {len(others)} {others[0]} record(s), so a {kind} sweep does not append to it: "
            "name another file"
        )
    return records


def rejected_path(path: str | Path) -> Path:
    """Where :func:`repair_tail` keeps the lines of ``path`` that are not records."""
    p = Path(path)
    return p.with_name(p.name + ".rejected")


def set_aside(source: Path, lines: list[tuple[int, bytes]], out: str | Path) -> None:
    """Append ``lines`` of ``source`` (line number, bytes) to ``out``'s :func:`rejected_path`, each after
    ``source``'s name and its number: lines that are not records are kept there, never deleted."""
    if not lines:
        return
    with rejected_path(out).open("ab") as f:
        for i, line in lines:
            f.write(f"{source.name}:{i}: ".encode() + line + b"\n")


def not_records(path: str | Path) -> list[tuple[int, bytes]]:
    """The lines of ``path`` (line number, bytes) that hold something other than a record."""
    lines = enumerate(_lines(Path(path)), 1)
    return [(i, x) for i, x in lines if x.strip() and not isinstance(_parse(x), dict)]


def _refuse_no_records(p: Path) -> tuple[list[bytes], list]:
    """(lines, lines that are not records) of the file ``p``; ResultsError where it holds no record at all
    (a text file named by mistake: not ours to append to), unless its one line is a record cut off (a
    sweep killed while it wrote its first: an object begun, no newline), which is then set aside."""
    lines = _lines(p)
    cut_first = len(lines) == 1 and lines[0].lstrip().startswith(b'{"') and _parse(lines[0]) == _CUT
    if lines and lines[-1] == b"":
        lines.pop()  # the empty piece after the final newline
    bad = not_records(p)
    if bad and len(bad) == sum(1 for x in lines if x.strip()) and not cut_first:
        raise ResultsError(
            f"{p} holds no results (none of its {len(bad)} lines is a JSON record), so it is not ours to "
            "append to: name another file"
        )
    return lines, bad


def repair_tail(path: str | Path) -> None:
    """Make ``path`` ready for appending without losing anything.

    Every record stays, a last one without its newline gets one. Lines that are not records are moved,
    with their line numbers, to :func:`rejected_path` (appended), and the file is rewritten atomically
    without them. A file that is all records is left byte for byte as it was (apart from that newline); one
    with no record at all (a text file named by mistake) is refused, :class:`ResultsError`, untouched.
    """
    p = Path(path)
    if not p.exists() or p.stat().st_size == 0:
        return
    lines, bad = _refuse_no_records(p)
    if not bad:
        if not p.read_bytes().endswith(b"\n"):
            with p.open("ab") as f:
                f.write(b"\n")
        return
    set_aside(p, bad, p)
    bad_numbers = {i for i, _ in bad}
    kept = [line for i, line in enumerate(lines, 1) if i not in bad_numbers]
    with replacing(p) as tmp:
        tmp.write_bytes(b"".join(line + b"\n" for line in kept))
    warnings.warn(
        f"{p}: {len(bad)} line(s) that are not records moved to {rejected_path(p)}",
        ResultsWarning,
        stacklevel=2,
    )


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one record as a line and push it to disk, so an interrupted run loses nothing finished."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())

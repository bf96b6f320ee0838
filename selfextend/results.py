"""JSON Lines results: appended one record at a time and flushed, read back tolerating a cut-off tail."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a JSONL file (none if it does not exist). A last line cut off by a kill is ignored."""
    p = Path(path)
    if not p.exists():
        return []
    records = []
    lines = p.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{p}:{i + 1} is not valid JSON") from None
    return records


def repair_tail(path: str | Path) -> None:
    """Cut an unterminated last line (left by a killed writer) so appends start on a fresh line."""
    p = Path(path)
    if not p.exists() or p.stat().st_size == 0:
        return
    data = p.read_bytes()
    if not data.endswith(b"\n"):
        p.write_bytes(data[: data.rfind(b"\n") + 1])


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one record as a line and push it to disk, so an interrupted run loses nothing finished."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())

"""Reads generated text on stdin and fails (exit 1) when a sentence occurs more than --most times.

CI runs `make demo` through it: the demo is the first thing a newcomer sees, and a small model that
loops ("She's a cruel mistress..." eighteen times) shows the sampling settings are wrong.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter


def sentences(text: str) -> list[str]:
    """The sentences of ``text``: runs ending in . ! ? or a line break, whitespace collapsed, lower case,
    those of fewer than four words left out (a short "Arr!" may well recur)."""
    parts = (" ".join(s.split()).lower() for s in re.split(r"(?<=[.!?])\s+|\n+", text))
    return [s for s in parts if len(s.split()) >= 4]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--most", type=int, default=2, help="times a sentence may occur (default 2)")
    args = parser.parse_args()
    text = sys.stdin.read()
    sys.stdout.write(text)
    counts = Counter(sentences(text))
    worst = counts.most_common(1)
    times = worst[0][1] if worst else 0
    print(f"\n[demo_repeats] {len(counts)} distinct sentences, the most repeated {times}x", file=sys.stderr)
    if times > args.most:
        print(f"[demo_repeats] repeated {times}x: {worst[0][0]!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

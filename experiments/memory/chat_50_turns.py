"""A scripted 50-turn conversation through ``selfextend chat`` in a 512-token cache: RSS stays flat.

Drives the real command through a pipe, one user turn at a time, each followed by ``/stats``; when
the stats line arrives the reply is complete, and the chat process's resident memory is read
(psutil). Writes experiments/memory/results/chat_50_turns.jsonl (one record per turn: RSS, shifts,
exchanges dropped, cache fill), chat_50_turns_transcript.txt, and chat_50_turns_summary.json
(RSS at turn 10 and turn 50 and their ratio). The persona asked for in the system prompt is
checked by asking "Who are you?" again after many turns have been dropped.

    python experiments/memory/chat_50_turns.py        # ~6 minutes on a 2-core CPU when idle
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).parent / "results"
SYSTEM = "You are Captain Redbeard, an old pirate. Always answer as Captain Redbeard, in pirate speech."
ARGS = ["--ctx", "512", "-n", "48", "--temperature", "0.7", "--seed", "1", "--repeat-penalty", "1.1"]
QUESTIONS = [
    "Who are you?",
    "What is the name of your ship?",
    "How many sailors are in your crew?",
    "What do you eat at sea?",
    "Where do you hide your treasure?",
    "What is your favourite island?",
    "Have you ever seen a sea monster?",
    "What do you do when a storm comes?",
    "Do you have a parrot?",
    "What is the best way to read a map?",
    "How do you find north without a compass?",
    "What songs does your crew sing?",
    "Who is your worst enemy?",
    "What is the bravest thing you have done?",
    "How old were you when you first went to sea?",
    "What do you think of the navy?",
    "How do you split the gold?",
    "What happens to a sailor who steals from the crew?",
    "What is your ship's flag like?",
    "Have you ever been shipwrecked?",
    "What do you miss about land?",
    "What advice would you give a young sailor?",
    "What is the strangest port you have visited?",
    "How do you keep the ship clean?",
    "Who are you?",
    "What is the most valuable thing you ever stole?",
    "Do pirates ever retire?",
    "What do you drink?",
    "How fast is your ship?",
    "What do you fear most?",
    "Tell me about your first mate.",
    "What is a good pirate name for me?",
    "How do you repair a torn sail?",
    "What do you do on a calm day?",
    "Have you ever buried treasure?",
    "What is the worst food you have eaten at sea?",
    "How do you deal with seasickness?",
    "What weapons do you carry?",
    "What is your favourite star?",
    "How do you talk to other ships?",
    "What did you do last birthday?",
    "What is the secret of a good captain?",
    "Where will you sail next?",
    "Do you believe in mermaids?",
    "What is your lucky charm?",
    "How do you celebrate a rich prize?",
    "What would you do if you lost your ship?",
    "What is your greatest regret?",
    "Tell me one last story.",
    "Who are you?",
]


def _drain(fd: int) -> str:
    """Everything the pipe holds now (a reply may contain blank lines itself)."""
    data = b""
    while select.select([fd], [], [], 0.5)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "selfextend", "chat", "--system", SYSTEM, *ARGS]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    child = psutil.Process(proc.pid)
    records, transcript = [], [f"$ selfextend chat --system {SYSTEM!r} {' '.join(ARGS)}", ""]
    stats_line = re.compile(
        r"(\d+) replies.*?(\d+) context shifts \((\d+) exchanges, (\d+) tokens dropped\), cache (\d+)/512"
    )
    for turn, question in enumerate(QUESTIONS, 1):
        proc.stdin.write(f"{question}\n/stats\n".encode())
        proc.stdin.flush()
        notes = []
        while True:
            line = proc.stderr.readline().decode()
            if not line:
                raise SystemExit(f"chat ended early at turn {turn}: {''.join(notes)}")
            if m := stats_line.search(line):
                break
            notes.append(line)
        reply = _drain(proc.stdout.fileno())  # written and flushed before the stats line
        record = {
            "turn": turn,
            "rss_mib": round(child.memory_info().rss / 2**20, 1),
            "shifts": int(m.group(2)),
            "exchanges_dropped": int(m.group(3)),
            "tokens_dropped": int(m.group(4)),
            "n_past": int(m.group(5)),
        }
        records.append(record)
        transcript += [f"> {question}", reply.rstrip("\n")]
        transcript += [n.rstrip("\n") for n in notes if n.startswith("[context shift")] + [""]
        print(json.dumps(record), flush=True)
    proc.stdin.close()
    proc.wait()
    (OUT / "chat_50_turns.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (OUT / "chat_50_turns_transcript.txt").write_text("\n".join(transcript) + "\n")
    rss10, rss50 = records[9]["rss_mib"], records[49]["rss_mib"]
    summary = {
        "rss_mib_turn_10": rss10,
        "rss_mib_turn_50": rss50,
        "rss_change": round(rss50 / rss10 - 1, 4),
        "shifts": records[-1]["shifts"],
        "exchanges_dropped": records[-1]["exchanges_dropped"],
        "tokens_dropped": records[-1]["tokens_dropped"],
        "command": " ".join(transcript[0].split()[1:]),
    }
    (OUT / "chat_50_turns_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

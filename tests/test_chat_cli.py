"""``selfextend chat`` never loses a conversation: a failing command keeps the session, and the
``--session`` file is written however the session ends; /reset starts the counts over; shift notes
stay out of a streamed reply (tiny model with the real tokenizer, in-process)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from selfextend.chat import ChatSession
from selfextend.cli.main import main


def chat(tiny_dir, session, lines: list[str], *extra: str):
    args = ["chat", "-m", str(tiny_dir), "--weights", "float", "--temperature", "0", "-n", "4"]
    args += ["--ctx", "200", "--session", str(session), *extra]
    return CliRunner().invoke(main, args, input="".join(line + "\n" for line in lines))


def saved_state(path) -> dict:
    return json.loads(torch.load(path, weights_only=True)["extra"])


def test_failed_save_keeps_the_session_and_the_session_file_is_written(tiny_dir, tmp_path):
    session = tmp_path / "talk.pt"
    r = chat(tiny_dir, session, ["Hello there", f"/save {tmp_path / 'no' / 'dir' / 'x.pt'}", "Still here?"])
    assert r.exit_code == 0, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no folder" in errors[0]
    # the turn after the error was answered: the error did not end the chat
    assert [e["user"] for e in saved_state(session)["exchanges"]] == ["Hello there", "Still here?"]


def test_save_does_not_overwrite_a_file_that_is_not_a_session(tiny_dir, tmp_path):
    """``/save notes.txt`` over a text file: refused, the file as it was (it was replaced by an archive); a
    session file saved before is overwritten as ever."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    earlier = tmp_path / "earlier.pt"
    session = tmp_path / "talk.pt"
    assert chat(tiny_dir, earlier, ["Hello there"]).exit_code == 0
    r = chat(tiny_dir, session, ["Hello there", f"/save {notes}", f"/save {earlier}", "Still here?"])
    assert r.exit_code == 0, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is not a saved session: not overwritten" in errors[0], r.stderr
    assert notes.read_text() == "my notes\n"
    assert [e["user"] for e in saved_state(earlier)["exchanges"]] == ["Hello there"]
    assert [e["user"] for e in saved_state(session)["exchanges"]] == ["Hello there", "Still here?"]


@pytest.mark.parametrize("how", ["quit", "error", "interrupt"])
def test_session_file_written_however_the_chat_ends(tiny_dir, tmp_path, monkeypatch, how):
    session = tmp_path / "talk.pt"
    lines = ["Hello there", "Second turn"]
    if how == "quit":
        lines.insert(1, "/quit")
    else:
        reply = ChatSession.reply
        calls = []

        def failing(self, user):
            calls.append(user)
            if len(calls) == 2:
                raise RuntimeError("disk on fire") if how == "error" else KeyboardInterrupt
            yield from reply(self, user)

        monkeypatch.setattr(ChatSession, "reply", failing)
    r = chat(tiny_dir, session, lines)
    assert session.exists(), r.output
    assert [e["user"] for e in saved_state(session)["exchanges"]] == ["Hello there"]
    assert "saved the session" in r.stderr
    assert any(line.startswith("1 reply,") for line in r.stderr.splitlines())  # the summary line
    if how == "error":
        assert r.exit_code != 0 and "disk on fire" in r.stderr


def test_reset_starts_the_stats_over(tiny_dir, tmp_path):
    r = chat(tiny_dir, tmp_path / "t.pt", ["One", "Two", "/stats", "/reset", "Three", "/stats"])
    assert r.exit_code == 0, r.output
    stats = [line for line in r.stderr.splitlines() if "tokens/s" in line]
    assert stats[0].startswith("2 replies,") and stats[1].startswith("1 reply,")


def test_a_command_after_spaces_is_a_command_and_two_slashes_send_one(tiny_dir, tmp_path):
    """`` /stats`` (a space typed first) runs the command, where it went to the model as text; ``//etc``
    sends "/etc" (no other way to begin a turn with a slash)."""
    session = tmp_path / "t.pt"
    r = chat(tiny_dir, session, ["One", "  /stats", "//etc/hosts is a file"])
    assert r.exit_code == 0, r.output
    assert any(line.startswith("1 reply,") for line in r.stderr.splitlines()), r.stderr
    assert [e["user"] for e in saved_state(session)["exchanges"]] == ["One", "/etc/hosts is a file"]


class Recorder:
    """Stands in for the terminal output: what was printed, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def text(self, text: str) -> None:
        self.events.append(("text", text))

    def note(self, line: str) -> None:
        self.events.append(("note", line))

    def restart_rate(self, tokens: int = 0) -> None:
        pass

    def tokens(self, tokens: int, shifts: int, n_past: int) -> None:
        pass


def test_context_shift_notes_come_before_or_after_a_reply_never_inside():
    from types import SimpleNamespace

    from selfextend.cli.chat import Repl

    notes: list[str] = []

    def reply():
        notes.append("[shift while the turn was written]")
        yield "Arr,"
        notes.append("[shift while the reply streamed]")
        yield " matey"

    session = SimpleNamespace(stop_requested=False, cache=SimpleNamespace(shifts=0, n_past=0))
    out = Recorder()
    Repl(session, out, quiet=False, interactive=False, notes=notes)._stream(reply())
    assert out.events == [
        ("note", "[shift while the turn was written]"),
        ("text", "Arr,"),
        ("text", " matey"),
        ("text", "\n\n"),
        ("note", "[shift while the reply streamed]"),
    ]


def test_undo_of_an_exchange_already_shifted_out_says_so(tiny_dir, tmp_path):
    """/undo past what the context shifts kept: the exchange is dropped from the conversation, and the line
    says the cache held none of it (it said "dropped the last exchange" with the cache unchanged)."""
    turns = ["One two three", "Four five six", "Seven eight nine", "Ten eleven twelve"]
    r = chat(tiny_dir, tmp_path / "t.pt", [*turns, *["/undo"] * 4], "--ctx", "64")
    assert r.exit_code == 0, r.output
    undone = [line for line in r.stderr.splitlines() if line.startswith("dropped the last exchange")]
    assert len(undone) == 4, r.stderr
    assert "shifted out" not in undone[0] and "shifted out" in undone[-1], undone
    assert undone[-1].startswith("dropped the last exchange (shifted out of the cache already); 0 exchanges")


def test_the_rest_of_a_cut_exchange_is_not_said_as_0_old_exchanges(tiny_dir, tmp_path):
    """A turn longer than --ctx is cut through shifts; at the next turn the rest of it goes up to where the
    new one starts, which was said "dropped 0 old exchanges, 92 tokens" beside stats that count 1."""
    r = chat(tiny_dir, tmp_path / "s.pt", ["word " * 300, "Summarize."], "--ctx", "128")
    assert r.exit_code == 0, r.output
    notes = [x for x in r.stderr.splitlines() if x.startswith("[context shift:")]
    assert any("cutting through a turn" in x for x in notes), notes
    assert any("the rest of an exchange cut before" in x for x in notes), notes
    assert not any("0 old exchanges" in x for x in notes), notes

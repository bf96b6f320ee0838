"""Session and slot files carry their settings: ``selfextend chat --session FILE`` resumes with the model,
--ctx, --keep, system prompt, -g/-w, --weights, --cache-type and sampling it was saved with; an explicit flag
that contradicts the file is refused naming both values and leaves the file as it was; a slot file restores
only into a server with the same settings (tiny model with the real tokenizer, in-process)."""

from __future__ import annotations

import copy
import hashlib
import json
import re

import pytest
import torch
from click.testing import CliRunner
from server_util import request, serving
from transformers import LlamaForCausalLM

import selfextend
from selfextend.cli.main import main

SAVED = ["--weights", "float", "--ctx", "200", "--keep", "20", "-g", "4", "-w", "32"]
SAVED += ["--system", "You are a pirate.", "--cache-type", "bf16", "--temperature", "0"]
TURNS = ["Hello there", "Where is the ship?"]


def chat(args: list[str], lines: list[str]):
    return CliRunner().invoke(main, ["chat", "-n", "6", *args], input="".join(line + "\n" for line in lines))


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def state(path) -> dict:
    return json.loads(torch.load(path, weights_only=True)["extra"])


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory):
    """A two-turn chat in one run, and the same chat saved after its first turn (``session``)."""
    d = tmp_path_factory.mktemp("sessions")
    whole = chat(["-m", str(tiny_dir), *SAVED], TURNS)
    assert whole.exit_code == 0, whole.output
    session = d / "talk.pt"
    first = chat(["-m", str(tiny_dir), *SAVED, "--session", str(session)], TURNS[:1])
    assert first.exit_code == 0, first.output
    return whole.stdout, first.stdout, session


def test_resume_without_flags_runs_with_the_saved_settings(runs, tiny_dir, tmp_path):
    whole, first, saved = runs
    session = tmp_path / "talk.pt"
    session.write_bytes(saved.read_bytes())
    r = chat(["--session", str(session)], ["/stats", TURNS[1], "/stats"])
    assert r.exit_code == 0, r.output
    resumed = next(line for line in r.stderr.splitlines() if line.startswith("resumed"))
    for setting in (
        f"-m {tiny_dir}",
        "--weights float",
        "-g 4 -w 32",
        "--ctx 200",
        "20 kept",
        "--cache-type bf16",
    ):
        assert setting in resumed, resumed  # read from the running model and cache, not from the file
    stats = [line for line in r.stderr.splitlines() if "context shift" in line and "kept" in line]
    assert re.search(r"cache \d+/200, 20 kept$", stats[0]) and re.search(r"cache \d+/200, 20 kept$", stats[1])
    # greedy (the saved --temperature 0) under the saved system prompt: the reply an unbroken run gave
    assert first + r.stdout == whole
    after = state(session)
    assert after["system"] == "You are a pirate." and [e["user"] for e in after["exchanges"]] == TURNS


CONTRADICTIONS = [
    (["--ctx", "512"], "--ctx 512", "--ctx 200"),
    (["-c", "512"], "--ctx 512", "--ctx 200"),
    (["-g", "8"], "-g 8", "-g 4 -w 32"),
    (["-g", "4", "-w", "64"], "-w 64", "-g 4 -w 32"),
    (["--weights", "int8"], "--weights int8", "--weights float"),
    (["--keep", "5"], "--keep 5", "--keep 20"),
    (["--system", "Be brief."], "--system 'Be brief.'", "--system 'You are a pirate.'"),
    (["--cache-type", "f32"], "--cache-type f32", "--cache-type bf16"),
    (["--dtype", "bfloat16"], "--dtype bfloat16", "--dtype float32"),
    (["-m", "smollm2-135m"], "-m smollm2-135m", "-m "),
]


@pytest.mark.parametrize(("flags", "given", "saved"), CONTRADICTIONS, ids=lambda x: " ".join(x))
def test_contradicting_flag_refused_naming_both_values(runs, flags, given, saved):
    session = runs[2]
    before = digest(session)
    r = chat(["--session", str(session), *flags], ["Hello"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "contradicts the session file" in lines[0]
    assert given in lines[0] and f"(saved with {saved}" in lines[0]
    assert digest(session) == before and r.stdout == ""


def test_system_file_that_contradicts_is_refused(runs, tmp_path):
    session = runs[2]
    before = digest(session)
    (tmp_path / "system.txt").write_text("Be brief.\n")
    r = chat(["--session", str(session), "--system-file", str(tmp_path / "system.txt")], [])
    assert r.exit_code == 2 and "--system 'Be brief.'" in r.stderr and digest(session) == before


def test_agreeing_flags_and_sampling_flags_accepted(runs, tiny_dir, tmp_path, monkeypatch):
    whole, first, saved = runs
    session = tmp_path / "talk.pt"
    session.write_bytes(saved.read_bytes())
    r = chat(["--session", str(session), "-m", str(tiny_dir), *SAVED], [TURNS[1]])
    assert r.exit_code == 0, r.output
    assert first + r.stdout == whole
    monkeypatch.chdir(tiny_dir.parent)  # the same model by a relative path, the same dtype by another name
    session.write_bytes(saved.read_bytes())
    assert chat(["--session", str(session), "-m", tiny_dir.name, "--dtype", "fp32"], []).exit_code == 0
    session.write_bytes(saved.read_bytes())
    r = chat(["--session", str(session), "--temperature", "1.5", "--top-k", "0", "--seed", "5"], ["/stats"])
    assert r.exit_code == 0 and "resumed" in r.stderr
    assert (
        state(session)["sampling"]["temperature"] == 1.5
    )  # an explicit sampling flag replaces the saved one
    assert state(session)["sampling"]["top_p"] == 0.95
    replies = []
    for seed in (["--seed", "5"], ["--seed", "5"], ["--seed", "6"], []):
        session.write_bytes(saved.read_bytes())
        r = chat(["--session", str(session), "--temperature", "1.5", "--top-k", "0", *seed], [TURNS[1]])
        assert r.exit_code == 0, r.output
        replies.append(r.stdout)
    assert (
        replies[0] == replies[1] != replies[2] and replies[3] not in replies[:3]
    )  # --seed replaces the file's


def test_keep_given_as_the_count_the_default_kept_agrees(tiny_dir, tmp_path):
    session = tmp_path / "talk.pt"
    r = chat(
        [
            "-m",
            str(tiny_dir),
            "--weights",
            "float",
            "--ctx",
            "128",
            "--system",
            "Hi",
            "--session",
            str(session),
        ],
        [],
    )
    assert r.exit_code == 0, r.output
    n_keep = state(session)["n_keep"]
    for keep in ("-1", str(n_keep)):
        assert chat(["--session", str(session), "--keep", keep], []).exit_code == 0
    r = chat(["--session", str(session), "--keep", str(n_keep + 1)], [])
    assert r.exit_code == 2 and f"the default --keep (the system prompt, {n_keep} tokens)" in r.stderr


def test_file_of_the_previous_format_resumes(runs, tiny_dir, tmp_path):
    """A selfextend-chat/1 file has no model name or cache type: -m names the model (as before), everything
    else comes from the file, the cache type from its cells."""
    whole, first, saved = runs
    payload = torch.load(saved, weights_only=True)
    old = json.loads(payload["extra"])
    del old["model"], old["cache_type"]
    payload["extra"] = json.dumps({**old, "kind": "selfextend-chat/1"})
    session = tmp_path / "old.pt"
    torch.save(payload, session)
    r = chat(["--session", str(session), "-m", str(tiny_dir)], [TURNS[1]])
    assert r.exit_code == 0, r.output
    assert "--ctx 200, 20 kept, --cache-type bf16" in r.stderr and "-g 4 -w 32" in r.stderr
    assert first + r.stdout == whole
    assert state(session)["kind"] == "selfextend-chat/2" and state(session)["model"] == str(tiny_dir)
    torch.save(payload, session)
    before = digest(session)
    r = chat(["--session", str(session)], [])  # the default model is not the one it was made with
    assert r.exit_code == 2 and "another model" in r.stderr and digest(session) == before


# --- slot files ------------------------------------------------------------------------------------


def fill_and_save(base: str, name: str) -> int:
    status, _ = request(
        base, "POST", "/v1/completions", {"prompt": "Keep this.", "max_tokens": 3, "id_slot": 0}
    )
    assert status == 200
    status, saved = request(base, "POST", "/slots/0?action=save", {"filename": name})
    assert status == 200
    return saved["n_saved"]


def refused(base: str, name: str) -> str:
    status, body = request(base, "POST", "/slots/0?action=restore", {"filename": name})
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "filename"
    return body["error"]["message"]


def test_slot_file_restores_only_into_a_server_with_its_settings(tiny, tmp_path):
    model, tok = tiny
    folder = str(tmp_path)
    with serving(model, tok, n_ctx=256, slot_save_path=folder) as (base, _):
        n = fill_and_save(base, "a.bin")
    saved = json.loads(torch.load(tmp_path / "a.bin", weights_only=True)["extra"])
    assert saved["kind"] == "selfextend-slot/2"
    assert saved["setup"] == {"model": "tiny", "ctx": 256, "cache_type": "float32"}
    with serving(model, tok, n_ctx=128, slot_save_path=folder) as (base, engine):
        message = refused(base, "a.bin")
        assert "--ctx 256" in message and "this server runs --ctx 128" in message
        assert engine.slots[0].gen is None or engine.slots[0].gen.tokens == []
    se = copy.deepcopy(model)
    selfextend.apply_self_extend(se, group_size=4, window=32)
    with serving(se, tok, n_ctx=256, slot_save_path=folder) as (base, _):
        message = refused(base, "a.bin")
        assert "saved with no Self-Extend" in message and "this server runs -g 4 -w 32" in message
    other = LlamaForCausalLM(model.config).eval()  # same shapes, other weights
    with serving(other, tok, n_ctx=256, slot_save_path=folder) as (base, _):
        message = refused(base, "a.bin")
        assert "another model (-m tiny" in message and "this server runs -m tiny" in message
    with serving(model, tok, n_ctx=256, slot_save_path=folder) as (base, engine):
        status, body = request(base, "POST", "/slots/0?action=restore", {"filename": "a.bin"})
        assert status == 200 and body["n_restored"] == n and len(engine.slots[0].gen.tokens) == n


def test_slot_file_of_the_previous_format_restores(tiny, tmp_path):
    model, tok = tiny
    with serving(model, tok, n_ctx=256, slot_save_path=str(tmp_path)) as (base, _):
        n = fill_and_save(base, "a.bin")
        payload = torch.load(tmp_path / "a.bin", weights_only=True)
        extra = json.loads(payload["extra"])
        del extra["setup"]
        payload["extra"] = json.dumps({**extra, "kind": "selfextend-slot/1"})
        torch.save(payload, tmp_path / "old.bin")
        status, body = request(base, "POST", "/slots/0?action=restore", {"filename": "old.bin"})
        assert status == 200 and body["n_restored"] == n


def _damaged(payload: dict) -> dict[str, object]:
    extra = json.loads(payload["extra"])
    settings = json.loads(payload["settings"])
    return {
        "garbage": b"\x00 not a torch file",
        "prompt-cache": {k: v for k, v in payload.items() if k != "extra"},
        "other-kind": {**payload, "extra": json.dumps({**extra, "kind": "selfextend-chat/9"})},
        "ctx-not-int": {**payload, "extra": json.dumps({**extra, "n_ctx": "200"})},
        "cache-type": {**payload, "extra": json.dumps({**extra, "cache_type": 16})},
        "self-extend": {**payload, "settings": json.dumps({**settings, "self_extend": "4x32"})},
        "other-model": {**payload, "settings": json.dumps({**settings, "model": "0123456789abcdef"})},
        **{
            name: {**payload, "extra": json.dumps(edit(copy.deepcopy(extra)))}
            for name, edit in HAND_EDITS.items()
        },
    }


def _set(path: str, value: object):
    """An edit of the session state: ``value`` put at ``path`` (dotted; a number picks a list's member)."""

    def edit(extra: dict) -> dict:
        *parents, last = path.split(".")
        node = extra
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(last) if last.isdigit() else last] = value
        return extra

    return edit


HAND_EDITS = {  # each once a traceback after the file was re-saved, or a resumed chat with nonsense in it
    "user-not-text": _set("exchanges.0.user", 123),
    "reply-null": _set("exchanges.0.reply", None),
    "replies-text": _set("stats.replies", "x"),
    "seconds-nan": _set("stats.seconds", float("nan")),
    "tokens-negative": _set("stats.tokens", -50),
    "shifts-negative": _set("shifts", -3),
    "n-keep-not-the-settings": _set("n_keep", 0),
    "sampling-list": _set("sampling", [1, 2]),
    # a saved sampling value no flag of the run gave: said without the file's name ("temperature must be...")
    "temperature-nan": _set("sampling.temperature", float("nan")),
    "top-p-2": _set("sampling.top_p", 2.0),
    "logit-bias-list": _set("sampling.logit_bias", [1, 2]),
}


@pytest.mark.parametrize(
    "case",
    ["garbage", "prompt-cache", "other-kind", "ctx-not-int", "cache-type", "self-extend", "other-model"]
    + list(HAND_EDITS),
)
def test_damaged_session_file_refused_in_one_line_and_left_alone(runs, tmp_path, case):
    content = _damaged(torch.load(runs[2], weights_only=True))[case]
    session = tmp_path / "bad.pt"
    if isinstance(content, bytes):
        session.write_bytes(content)
    else:
        torch.save(content, session)
    before = digest(session)
    r = chat(["--session", str(session)], ["Hello"])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "bad.pt" in lines[0] and digest(session) == before and r.stdout == ""


def test_an_empty_system_prompt_agrees_with_the_file_it_made(tiny_dir, tmp_path):
    """``--system ""`` is no system prompt: the file it saved resumes under the same command (it was
    refused as contradicting "no system prompt")."""
    args = ["-m", str(tiny_dir), "--weights", "float", "--ctx", "200", "--system", "", "--temperature", "0"]
    args += ["--session", str(tmp_path / "e.pt")]
    first = chat(args, ["Hello"])
    assert first.exit_code == 0, first.output
    again = chat(args, ["Hello"])
    assert again.exit_code == 0 and "resumed" in again.stderr, again.output


def test_a_saved_logit_bias_resumes(tiny, tmp_path):
    """JSON writes a logit bias's token ids as text; a resumed chat reads them back as ids (it was refused:
    "logit bias token must be an integer")."""
    from selfextend.chat import ChatSession
    from selfextend.chat.sessionfile import saved_settings
    from selfextend.generation.sampling import SamplingParams

    model, tok = tiny
    s = ChatSession(model, tok, n_ctx=64, sampling=SamplingParams(logit_bias={42: -5.0}), max_new_tokens=2)
    s.save(tmp_path / "lb.pt")
    assert saved_settings(tmp_path / "lb.pt").sampling["logit_bias"] == {42: -5.0}

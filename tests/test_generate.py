"""Generation loop and the ``generate`` command: sampling, streaming text, errors, prompt cache."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from selfextend.cli.main import main
from selfextend.core.validate import ValidationError
from selfextend.generation.sampling import SamplingParams, argmax, distribution, sample
from selfextend.generation.text import StopMatcher, TextStream

NONE = torch.tensor([], dtype=torch.long)
P = torch.tensor([0.5, 0.3, 0.15, 0.05])  # a distribution whose filtered sets are easy to work out by hand
LOGITS = P.log()


def _expect(kept: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The llama.cpp result by hand: the kept tokens' probabilities to the power 1/T, renormalised."""
    q = torch.zeros(4)
    q[kept] = P[kept] ** (1 / temperature)
    return q / q.sum()


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), _expect([0, 1, 2, 3])),
        (SamplingParams(temperature=1.0, top_k=2), _expect([0, 1])),
        # top-p: the smallest prefix whose mass reaches p (0.5 < 0.7 <= 0.8)
        (SamplingParams(temperature=1.0, top_p=0.7), _expect([0, 1])),
        (SamplingParams(temperature=1.0, top_p=0.85), _expect([0, 1, 2])),
        # min-p: p >= 0.2 * 0.5 keeps three
        (SamplingParams(temperature=1.0, min_p=0.2), _expect([0, 1, 2])),
        # temperature last: the filters see the untempered distribution. At T = 2 tempering first would
        # lift the last token to 0.12 of the mass, above min-p's 0.2 * 0.379; llama.cpp's order drops it.
        (SamplingParams(temperature=2.0, min_p=0.2), _expect([0, 1, 2], 2.0)),
        (SamplingParams(temperature=0.5, top_p=0.7), _expect([0, 1], 0.5)),
        (SamplingParams(temperature=2.0, top_k=3, top_p=0.7), _expect([0, 1], 2.0)),
    ],
    ids=["plain", "top-k", "top-p 0.7", "top-p 0.85", "min-p", "min-p T=2", "top-p T=0.5", "top-k top-p T=2"],
)
def test_distribution_matches_hand_computed(params, expected):
    assert torch.allclose(distribution(LOGITS, params, NONE), expected, atol=1e-6)


def test_penalties_by_hand():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    recent = torch.tensor([1, 3, 3])
    # CTRL repeat penalty: positive logits divided, negative multiplied, once per distinct token
    p = SamplingParams(repetition_penalty=2.0)
    assert torch.allclose(distribution(logits, p, recent), torch.tensor([0.0, 0.0, 1.0, 0.0]))
    p = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    assert torch.allclose(
        distribution(logits, p, recent), torch.softmax(torch.tensor([0.0, 1.5, 2.9, -2.0]), 0)
    )
    # frequency: minus 0.5 per occurrence; presence: minus 1 once per token present
    p = SamplingParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=1.0)
    want = torch.tensor([0.0, 3.0 - 0.5 - 1.0, 2.9, -1.0 - 1.0 - 1.0])
    assert torch.allclose(distribution(logits, p, recent), torch.softmax(want, 0))
    # penalties come before the filters: the penalised token 1 falls out of top-1
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1, repetition_penalty=2.0), recent) == 2


def test_sampling_draws_from_the_distribution():
    g = torch.Generator().manual_seed(0)
    picks = torch.tensor(
        [sample(LOGITS, SamplingParams(temperature=1.0, top_p=0.85), NONE, g) for _ in range(3000)]
    )
    freq = torch.bincount(picks, minlength=4).float() / picks.numel()
    assert torch.allclose(freq, _expect([0, 1, 2]), atol=0.03)


@pytest.mark.parametrize("vocab", [4, 1000, 262144])
def test_draws_after_top_k_are_from_the_same_distribution(vocab):
    """Sampling after top-k runs top-p, min-p and temperature on the candidates only: their probabilities
    are the whole chain's (transformers' processors over the vocabulary), which is zero elsewhere; ties at
    the k-th score are kept, as TopKLogitsWarper keeps them; penalties come first."""
    from selfextend.generation.sampling import candidate_distribution

    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(vocab, generator=g) * 3).round()  # many ties
    recent = torch.randint(0, vocab, (20,), generator=g)
    for params in (
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # generate's defaults
        SamplingParams(temperature=1.5, top_k=3, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.7, top_k=vocab + 5, top_p=0.5),
    ):
        want = distribution(logits, params, recent)
        ids, probs = candidate_distribution(logits, params, recent)
        got = torch.zeros(vocab).index_put_((ids,), probs)
        assert torch.allclose(got, want, atol=1e-6)
        assert len(ids) >= min(params.top_k, vocab)  # the k best and any tied with the k-th
    picks = torch.tensor(
        [sample(LOGITS, SamplingParams(1.0, top_k=3, top_p=0.85), NONE, g) for _ in range(3000)]
    )
    assert torch.allclose(
        torch.bincount(picks, minlength=4).float() / picks.numel(), _expect([0, 1, 2]), atol=0.03
    )


def test_greedy_argmax_is_torch_argmax_with_ties_infinities_and_nan():
    """The greedy pick (NumPy's argmax on the CPU) is ``torch.argmax``'s with NaNs taken as -inf: the first
    of tied maxima, +-inf, strided rows, float64 and bfloat16 (which goes through torch); a row with no
    number above -inf (NaNs: a broken model's logits; all -inf: every token banned; greedy read both as
    token 0 before) is refused."""
    g = torch.Generator().manual_seed(0)
    for trial in range(500):
        x = torch.randint(-3, 4, (int(torch.randint(1, 200, (1,), generator=g)),), generator=g).float()
        for special in (math.nan, math.inf, -math.inf):
            x[torch.rand(x.numel(), generator=g) < 0.05] = special
        for row in (x, x[::3], x.double(), x.bfloat16()):
            numbers = torch.where(row.isnan(), float("-inf"), row)
            if not bool((numbers > float("-inf")).any()):
                with pytest.raises(ValueError, match="no logit is a finite number|every logit is -inf"):
                    argmax(row)
                continue
            assert argmax(row) == int(torch.argmax(numbers)), (trial, row)
    for row in (
        torch.full((9,), math.nan),
        torch.tensor([-math.inf, math.nan]),
        torch.full((3,), math.nan).bfloat16(),
    ):
        with pytest.raises(ValueError, match="no logit is a finite number"):
            argmax(row)
    for row in (torch.full((9,), -math.inf), torch.full((9,), -math.inf).bfloat16()):
        with pytest.raises(ValueError, match="every logit is -inf"):
            argmax(row)
    assert sample(torch.tensor([1.0, 3.0, 3.0, -math.inf]), SamplingParams(), NONE) == 1
    assert sample(torch.tensor([1.0, math.nan, 3.0]), SamplingParams(temperature=0), NONE) == 2


def test_a_temperature_or_top_p_near_zero_is_greedy():
    """Below 1e-4 (the server's rule, now the library's: 1e-45 overflowed the draw, torch's "probability
    tensor contains inf" after the model loaded) the settings are greedy's; 0 keeps the given top_p."""
    for params in (SamplingParams(temperature=1e-45), SamplingParams(temperature=1.0, top_p=5e-324)):
        params.validate()
        assert (params.temperature, params.top_p) == (0.0, 1.0)
        assert sample(LOGITS, params, NONE) == int(LOGITS.argmax())
    greedy = SamplingParams(temperature=0, top_p=0.9)
    greedy.validate()
    assert greedy.top_p == 0.9


def test_nan_logits_are_skipped_or_refused():
    """A NaN logit is never drawn, however many there are; logits that are all NaN raise a ValueError that
    says so."""
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    logits[::7] = float("nan")
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    g = torch.Generator().manual_seed(2)
    assert all(sample(logits, params, NONE, g) % 7 for _ in range(200))
    with pytest.raises(ValueError, match="no logit is a finite number"):
        sample(torch.full((1000,), float("nan")), params, NONE)


def test_generator_seed_repeats_and_differs(tiny_dir):
    """Generator(seed=...) gives the same tokens for the same seed, others for another seed."""
    from selfextend.generation.generator import Generator
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models import load_model

    model, _ = load_model(str(tiny_dir))
    params = SamplingParams(temperature=1.5)

    def tokens(seed: int) -> list[int]:
        gen = Generator(model, ContextShiftCache(model, 64), params, seed=seed)
        return list(gen.decode(gen.feed([1, 2, 3]), max_new_tokens=20))

    assert tokens(7) == tokens(7)
    assert tokens(7) != tokens(8)


def test_a_reset_cache_starts_the_generator_afresh(tiny_dir):
    """``cache.reset()`` (transformers' Cache method) empties the cells; the generator's tokens went on, so
    the penalties read tokens no longer there and the output differed from a fresh run's."""
    from selfextend.generation.generator import Generator, run
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models import load_model

    model, _ = load_model(str(tiny_dir))
    params = SamplingParams(repetition_penalty=1.5, repeat_last_n=-1)
    prompt = list(range(5, 30))

    def reply(gen: Generator) -> list[int]:
        return [t for t, _ in run(gen, prompt, 12)]

    fresh = reply(Generator(model, ContextShiftCache(model, 64), params))
    gen = Generator(model, ContextShiftCache(model, 64), params)
    reply(gen)
    gen.cache.reset()
    assert reply(gen) == fresh and len(gen.tokens) == gen.cache.n_past


def test_stop_matcher_holds_back_partial_stop():
    m = StopMatcher(["END"])
    assert m.push("hello E") == ("hello ", False)
    assert m.push("N") == ("", False)
    assert m.push("Dx") == ("", True)
    m = StopMatcher(["END"])
    assert m.push("hello EX") == ("hello EX", False)


@pytest.mark.parametrize("stops", [["Blue", " "], [" ", "Blue"]])
def test_the_earliest_stop_string_in_the_text_stops_whatever_its_place_in_the_list(stops):
    """The first string listed that matched anywhere used to win: "1. Blue" with ["Blue", " "] gave "1. "."""
    assert StopMatcher(stops).push("1. Blue") == ("1.", True)


def test_a_special_token_stop_is_matched_by_its_id(tiny):
    """``<|im_end|>`` never shows in the streamed text (special tokens are left out), so it stops by id;
    the text held back for another stop string is given out as the reply's end."""
    tok = tiny[1]
    m = StopMatcher(["<|im_end|>", "END"], tok)
    assert m.token_ids == {tok.convert_tokens_to_ids("<|im_end|>")}
    assert m.push("hello E", 500) == ("hello ", False)
    assert m.push("", tok.convert_tokens_to_ids("<|im_end|>")) == ("E", True)
    assert StopMatcher(["hello", "<|im_end|>x"], tok).token_ids == frozenset()  # text, not a token's


@pytest.mark.real
def test_stop_at_the_chat_end_token_with_ignore_eos_ends_where_eos_does():
    """--ignore-eos --stop "<|im_end|>" writes the reply the plain run ends at EOS (<|im_end|> is the
    default model's EOS), and says it stopped at a stop string."""
    args = ["generate", "-p", "Say hi.", "--temp", "0", "-n", "80"]
    plain, stopped = invoke(*args), invoke(*args, "--ignore-eos", "--stop", "<|im_end|>")
    assert plain.exit_code == stopped.exit_code == 0, plain.stderr + stopped.stderr
    assert "stopped: end of sequence" in plain.stderr and "stopped: stop string" in stopped.stderr
    assert stopped.stdout == plain.stdout and len(plain.stdout.split()) > 3
    assert invoke(*args, "-n", "40", "--ignore-eos").stdout != plain.stdout  # it would go on past it


class ByteTokenizer:
    """Decodes token ids as UTF-8 bytes: a multi-byte character spans several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_never_splits_characters():
    data = "naïve café — 日本".encode()
    stream = TextStream(ByteTokenizer())
    pieces = [stream.push(b) for b in data]
    assert "".join(pieces) == "naïve café — 日本"
    assert all("\ufffd" not in p for p in pieces)


def test_text_stream_keeps_a_short_window_on_the_real_tokenizer():
    """An endless run's detokenizer holds a few ids, not every token it wrote, and still gives the text of
    decoding all of them at once (the real SmolLM2 tokenizer: its spacing rules need the prefix)."""
    from transformers import AutoTokenizer

    from selfextend.models.diskcache import ensure_converted

    tokenizer = AutoTokenizer.from_pretrained(ensure_converted("smollm2-135m"))
    ids = tokenizer("Once upon a time, naïve café owners — 日本 — wrote 12,345 lines.\n" * 40)["input_ids"]
    stream = TextStream(tokenizer)
    pieces, longest = [], 0
    for t in ids:
        pieces.append(stream.push(t))
        longest = max(longest, len(stream.ids))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert longest <= 8 < len(ids)


# The command, on the real default model (converted once, then loaded from the user cache).


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ctx", "64", "--keep", "64"], "--keep"),
        (["--ctx", "64", "--keep", "100"], "--keep"),
        (["--ctx", "-5"], "--ctx"),
        (["--ctx", "0"], "--ctx"),
        (["-g", "4"], "--window"),
        (["-g", "0", "-w", "16"], "--group-size"),
        (["-g", "2", "-w", "9000"], "trained window"),
    ],
)
def test_bad_flags_one_line_error(args, message):
    r = invoke("generate", "-p", "hi", "-n", "1", *args)
    assert r.exit_code != 0
    # the first load of a form in this test session's fresh model cache also says it converts (once), and
    # the first use of the kernels that they compile (once)
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith(("converting ", "compiling the "))]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


def test_unreadable_prompt_files(tmp_path):
    r = invoke("generate", "-f", str(tmp_path / "missing.txt"))
    assert r.exit_code != 0 and r.stderr.strip().count("\n") == 0 and "cannot read" in r.stderr
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    r = invoke("generate", "-f", str(bad))
    assert r.exit_code != 0 and "not UTF-8" in r.stderr and r.stderr.strip().count("\n") == 0
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    r = invoke("generate", "-f", str(empty))
    assert r.exit_code != 0 and "empty" in r.stderr


@pytest.mark.real
def test_prompt_cache_gives_same_greedy_output(tmp_path):
    pc = tmp_path / "prompt.cache"
    args = [
        "generate",
        "-p",
        "List three facts about owls.",
        "--temperature",
        "0",
        "-n",
        "24",
        "--ctx",
        "512",
    ]
    plain = invoke(*args)
    assert plain.exit_code == 0, plain.stderr
    first = invoke(*args, "--prompt-cache", str(pc))
    assert first.exit_code == 0 and pc.exists()
    second = invoke(*args, "--prompt-cache", str(pc))
    assert second.exit_code == 0 and "from the prompt cache" in second.stderr
    assert plain.stdout == first.stdout == second.stdout
    assert len(plain.stdout.split()) > 5
    # at a --ctx the prompt overflows, the file is not read: its cells would shift elsewhere than the prompt
    # read whole, and the reply differed from the one without it
    short = [*args[:-1], "30"]  # the prompt: 36 tokens
    without = invoke(*short)
    read = invoke(*short, "--prompt-cache", str(pc))
    assert read.exit_code == 0 and "not read: the prompt goes through" in read.stderr, read.stderr
    assert read.stdout == without.stdout and "from the prompt cache" not in read.stderr


def test_fingerprint_ignores_where_the_model_was_loaded_from():
    """A GGUF used right after its conversion and later from the cache (or another cache folder) is one
    model: prompt caches and chat sessions saved by the first run load in the next. Not so another model."""
    from conftest import make_model

    from selfextend.kv.promptcache import fingerprint

    model = make_model("llama")
    before = fingerprint(model)
    model.config._name_or_path = "/somewhere/else/SmolLM2-int8-float32-0123"
    model.config.transformers_version = "0.0.0"
    assert fingerprint(model) == before
    model.config.num_attention_heads += 1
    assert fingerprint(model) != before
    assert fingerprint(make_model("qwen2")) != before


def test_a_prompt_cache_not_written_is_said_and_the_run_goes_on(tiny_dir, tmp_path, monkeypatch):
    """A folder that is missing: refused before the model loads. A file that cannot be written once the
    prompt is read (torch's writer failed the run in a C++ message, with no text), and a prompt read
    through context shifts (nothing was written, nothing said): a line each, the text whole."""
    import selfextend.kv.promptcache as promptcache

    args = ["generate", "-m", str(tiny_dir), "--temp", "0", "-n", "4", "--ignore-eos", "--no-chat"]
    r = invoke(*args, "-p", "hello there", "--prompt-cache", str(tmp_path / "no" / "such" / "p.bin"))
    assert r.exit_code == 2 and "no writable folder" in r.stderr, r.stderr

    def full_disk(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:747] . open file failed with strerror: Disk full"
        )

    with monkeypatch.context() as m:
        m.setattr(promptcache, "save", full_disk)
        r = invoke(*args, "-p", "hello there", "--prompt-cache", str(tmp_path / "p.bin"))
    assert r.exit_code == 0 and r.stdout.strip() and "enforce" not in r.stderr, r.stderr
    assert f"warning: --prompt-cache {tmp_path / 'p.bin'} not written: Disk full" in r.stderr
    r = invoke(*args, "-p", "word " * 100, "--ctx", "64", "--prompt-cache", str(tmp_path / "long.bin"))
    assert r.exit_code == 0 and "not written: the prompt went through context shifts" in r.stderr, r.stderr
    assert not (tmp_path / "long.bin").exists()


@pytest.mark.real
def test_mismatched_prompt_cache_refused(tmp_path):
    garbage = tmp_path / "garbage.cache"
    garbage.write_bytes(b"not a cache")
    r = invoke("generate", "-p", "hi", "-n", "1", "--prompt-cache", str(garbage))
    assert r.exit_code != 0 and "not a selfextend prompt cache" in r.stderr
    # the first use of this session's fresh cache also says it compiles the native kernels and converts the
    # model (once each: whichever test comes first)
    said = [x for x in r.stderr.strip().splitlines() if not x.startswith(("compiling the ", "converting "))]
    assert len(said) == 1, said
    pc = tmp_path / "se.cache"
    assert invoke("generate", "-p", "hi", "-n", "2", "--prompt-cache", str(pc)).exit_code == 0
    r = invoke("generate", "-p", "hi", "-n", "1", "-g", "2", "-w", "512", "--prompt-cache", str(pc))
    assert r.exit_code != 0 and "another model or settings" in r.stderr
    assert r.stderr.strip().count("\n") == 0


@pytest.mark.real
def test_output_file_appends_and_shifts_reported(tmp_path):
    out = tmp_path / "out.txt"
    out.write_text("before\n")
    r = invoke(
        "generate",
        "-p",
        "Count from one to one hundred in words.",
        "--temperature",
        "0",
        "-n",
        "120",
        "--ctx",
        "96",
        "--ignore-eos",
        "--output",
        str(out),
    )
    assert r.exit_code == 0, r.stderr
    text = out.read_bytes()  # bytes: read_text would turn a "\r" in the text into "\n"
    body = text[len(b"before\n") :]  # the text, ended with a newline for the next run (stdout's own last)
    assert (
        text.startswith(b"before\n")
        and body.endswith(b"\n")
        and body in (r.stdout_bytes, r.stdout_bytes[:-1])
    )
    summary = r.stderr.strip().splitlines()[-1]
    assert "120 tokens" in summary and "context shift" in summary
    assert int(summary.split(" context shift")[0].rsplit(" ", 1)[-1]) >= 1


def test_zero_new_tokens_reads_the_prompt_and_prints_the_summary(tiny_dir, tmp_path):
    pc = tmp_path / "prompt.pt"
    r = invoke(
        "generate",
        "-m",
        str(tiny_dir),
        "--weights",
        "float",
        "-p",
        "Hello",
        "-n",
        "0",
        "--prompt-cache",
        str(pc),
    )
    assert r.exit_code == 0, r.output
    summary = r.stderr.strip().splitlines()[-1]
    assert summary.startswith("0 tokens in") and "stopped: max tokens" in summary
    assert pc.exists()  # the prompt alone was what was asked for: it is cached


@pytest.mark.parametrize("cells", [torch.float32, torch.bfloat16])
def test_greedy_reply_is_the_same_fresh_or_cached(tiny_dir, cells):
    """Issue 30 item 7: a prompt computed fresh and the same prompt with all but its last token cached
    (what a repeated server request does) give bit-identical first logits and the same greedy tokens: the
    last prompt token goes through the decode step both times, over the cells as stored."""
    from selfextend.generation.generator import Generator, run
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models import load_model

    model, tok = load_model(str(tiny_dir))
    prompt = tok("A fresh prompt and a cached prompt give the same reply, token for token").input_ids

    def reply(gen: Generator, reused: int) -> tuple[list[int], torch.Tensor]:
        tokens, first = [], None
        for token, _ in run(gen, prompt, 12, reused=reused):
            first = gen.last_logits.clone() if first is None else first  # the prompt's, before any write
            tokens.append(token)
        return tokens, first

    gen = Generator(model, ContextShiftCache(model, 128, dtype=cells))
    fresh, fresh_logits = reply(gen, 0)
    gen.rewind(len(prompt))  # the cache holds the prompt (without its logits), as a slot after a request
    cached, cached_logits = reply(gen, len(prompt))
    other = Generator(model, ContextShiftCache(model, 128, dtype=cells))
    again, again_logits = reply(other, 0)
    assert torch.equal(fresh_logits, cached_logits) and torch.equal(fresh_logits, again_logits)
    assert fresh == cached == again and len(fresh) == 12


def test_rewind_forgets_the_logits_of_the_tokens_it_drops(tiny_dir):
    """After going back, ``last_logits`` are never those of a forgotten token (a chat's /undo or a stop
    string's cut then saved them beside the shorter token list): None where the new last token's are not
    known, and what a fresh feed gives once it is fed again."""
    from selfextend.generation.generator import Generator
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models import load_model

    model, tok = load_model(str(tiny_dir))
    ids = tok("Going back forgets what came after the point it goes back to").input_ids
    gen = Generator(model, ContextShiftCache(model, 128))
    gen.feed(ids)
    gen.rewind(len(ids))  # nothing dropped: the logits still belong to the last token
    assert gen.last_logits is not None
    gen.rewind(len(ids) - 3)
    assert gen.last_logits is None and gen.tokens == ids[:-3]
    again = gen.feed(ids[-3:])
    fresh = Generator(model, ContextShiftCache(model, 128)).feed(ids)
    assert torch.allclose(again, fresh, atol=1e-4) and torch.equal(gen.last_logits, again)


def test_logit_bias_adds_and_bans():
    """Issue 30 item 6: a bias is added to its token's logit before every other step; -inf bans the token
    from greedy and sampled draws alike (top-k's candidates included)."""
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    bias = SamplingParams(temperature=1.0, logit_bias={1: -math.inf, 3: 1.5})
    expected = torch.softmax(torch.tensor([1.0, -math.inf, 2.0, 2.0]), -1)
    assert torch.allclose(distribution(logits, bias, torch.tensor([])), expected)
    assert sample(logits, SamplingParams(logit_bias={1: -math.inf}), torch.tensor([])) == 2
    assert sample(logits, SamplingParams(logit_bias={0: 100}), torch.tensor([])) == 0
    rng = torch.Generator().manual_seed(0)
    for top_k in (0, 2):
        params = SamplingParams(temperature=2.0, top_k=top_k, logit_bias={1: -math.inf, 2: -math.inf})
        assert {sample(logits, params, torch.tensor([]), rng) for _ in range(200)} == {0, 3}
    with pytest.raises(ValueError, match="logit bias"):
        SamplingParams(logit_bias={1: 101}).validate()
    every = SamplingParams(logit_bias=dict.fromkeys(range(4), -math.inf))  # greedy took id 0 of them
    with pytest.raises(ValidationError, match="bans every one of the 4 token ids"):
        every.check_ids(4)
    every.check_ids(5)  # a table of 5: one id left
    with pytest.raises(ValidationError, match="4 is past the model's 4 token ids"):
        SamplingParams(logit_bias={4: 1.0}).check_ids(4)


def test_logit_bias_tensors_are_built_once_per_table():
    """A bias table is turned into tensors once, not at every token (50,000 text keys cost 1.6x a token);
    a table assigned anew, as validate() does, is read anew."""
    params = SamplingParams(logit_bias={3: 2.0})
    first = params.bias()
    assert params.bias() is first
    params.logit_bias = {0: -math.inf}
    assert params.bias() is not first
    assert sample(torch.tensor([1.0, 3.0, 2.0, 0.5]), params, torch.tensor([])) == 1
    params.logit_bias = {1: -math.inf}
    params.validate()
    assert sample(torch.tensor([1.0, 3.0, 2.0, 0.5]), params, torch.tensor([])) == 2


def test_grammar_keeps_a_random_model_to_the_schema(tiny_dir):
    """Issue 30 item 6: with a JSON schema's grammar, even a random model's greedy reply is a document the
    schema accepts, ended by an end-of-sequence token."""
    import jsonschema

    from selfextend.generation.generator import Generator, run
    from selfextend.generation.grammar import Grammar
    from selfextend.generation.text import eos_token_ids
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models import load_model

    model, tok = load_model(str(tiny_dir))
    eos = eos_token_ids(model, tok)
    gen = Generator(model, ContextShiftCache(model, 128), grammar=Grammar(tok, SCHEMA, eos))
    tokens = [t for t, _ in run(gen, tok("Give me JSON:").input_ids, 80, eos)]
    assert tokens[-1] in eos
    jsonschema.validate(json.loads(tok.decode(tokens[:-1])), SCHEMA)


SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["colour", "count", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "n_system,n_prompt,n_ctx,kept",
    [(0, 800, 512, 4), (1, 800, 512, 1), (36, 800, 512, 36), (0, 2, 512, 2), (0, 800, 5, 3), (0, 800, 2, 0)],
)
def test_default_keep_is_the_system_part_or_the_first_tokens(n_system, n_prompt, n_ctx, kept):
    from selfextend.kv.cache import default_keep

    assert default_keep(n_system, n_prompt, n_ctx) == kept


ITEMS = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(90)) + " Item 90 is a"


@pytest.mark.real
def test_a_prompt_without_bos_keeps_its_first_tokens_through_shifts(tmp_path):
    """SmolLM2 has no BOS: with nothing kept, its first shift drops the tokens its attention rests on and the
    text falls apart; the default keeps the first 4 (attention sinks), so the list goes on. The same prompt
    with ``--keep 0`` is the counterexample (the test could fail)."""
    items = tmp_path / "items.txt"
    items.write_text(ITEMS)
    args = ["generate", "--no-chat", "-f", str(items), "--ctx", "512", "--temperature", "0", "-n", "14"]
    kept, dropped = invoke(*args), invoke(*args, "--keep", "0")
    assert kept.exit_code == 0 and dropped.exit_code == 0, kept.stderr
    assert "2 context shifts" in kept.stderr and "2 context shifts" in dropped.stderr
    assert kept.stdout.startswith(" red box. Item 91 is a blue box.")
    assert "Item 91" not in dropped.stdout


def test_a_completion_keeps_its_bos_or_its_first_tokens(tiny):
    """The server's completion prompts keep as ``generate`` does: the default model's tokenizer has no BOS,
    so the first 4 tokens; a chat keeps its system part; ``n_keep`` given is taken as given."""
    from selfextend.server.prompts import chat_prompt, completion_prompt
    from selfextend.server.schemas import Message

    _, tok = tiny
    assert tok.bos_token_id is None or tok("Item 1").input_ids[0] != tok.bos_token_id
    assert completion_prompt(tok, ITEMS, None, n_ctx=512).n_keep == 4
    assert completion_prompt(tok, "Hi there", None, n_ctx=4).n_keep == 2
    assert completion_prompt(tok, ITEMS, 0, n_ctx=512).n_keep == 0
    chat = chat_prompt(
        tok, [Message(role="system", content="Be brief."), Message(role="user", content="Hi")], None
    )
    assert chat.n_keep == len(
        tok.apply_chat_template([{"role": "system", "content": "Be brief."}])["input_ids"]
    )


def test_library_refuses_an_empty_prompt_and_a_batched_cache_in_its_own_words(tiny):
    """``run(gen, [])`` said "n_past must be an integer >= 0, got -1"; a Generator over a cache of two
    sequences was made, then its first feed failed in a matrix product."""
    from selfextend.core.validate import ValidationError
    from selfextend.generation.generator import Generator, run
    from selfextend.kv.cache import ContextShiftCache

    model, _ = tiny
    with pytest.raises(ValidationError, match="prompt is empty"):
        list(run(Generator(model, ContextShiftCache(model, n_ctx=64)), [], 2))
    with pytest.raises(ValidationError, match=r"one sequence \(batch_size=1\), not 2"):
        Generator(model, ContextShiftCache(model, n_ctx=64, batch_size=2))


def test_run_refuses_a_reused_count_or_eos_ids_that_do_not_fit(tiny):
    """``reused`` past the prompt, negative, or more than the cache holds wrote the prompt after the wrong
    cells and replied to another text without a word; eos ids of the wrong type failed after the prefill."""
    from selfextend.core.validate import ValidationError
    from selfextend.generation.generator import Generator, run
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models.blocks import TokenIdError

    model, _ = tiny
    prompt = [5, 6, 7, 8, 9, 10]
    gen = Generator(model, ContextShiftCache(model, n_ctx=64))
    for reused, said in [(100, "at most 6"), (-5, r"in \[0, 6\], got -5"), (5, "the cache holds 0 tokens")]:
        with pytest.raises(ValidationError, match=said):
            next(run(gen, prompt, 2, reused=reused))
    with pytest.raises(TokenIdError):
        next(run(gen, prompt, 2, eos_token_ids="abc"))
    with pytest.raises(TokenIdError, match="must lie in"):
        next(run(gen, prompt, 2, eos_token_ids=[10**9]))
    assert gen.tokens == []  # nothing was written
    gen.feed(prompt[:4])
    with pytest.raises(ValidationError, match="not the prompt's token 2"):
        next(run(gen, prompt, 2, reused=3))
    fresh = Generator(model, ContextShiftCache(model, n_ctx=64))
    assert [t for t, _ in run(gen, prompt, 3, reused=4)] == [t for t, _ in run(fresh, prompt, 3)]


def test_a_full_cache_under_transformers_generate_says_what_to_use(tiny):
    """transformers' generate() over a ContextShiftCache runs while the cells last, then stops with an
    error of the documented kind (a ValueError) that says where shifting generation is (a RuntimeError
    "KV cache overflow" before)."""
    from selfextend.core.validate import ValidationError
    from selfextend.kv.cache import ContextShiftCache

    model, _ = tiny
    ids = torch.randint(3, 200, (1, 20))
    cache = ContextShiftCache(model, n_ctx=24)
    with pytest.raises(ValidationError, match=r"is full: 24 cells \+ 1 new > 24; call make_room\(1\)"):
        model.generate(ids, past_key_values=cache, max_new_tokens=10, do_sample=False)


def test_top_k_one_is_greedy_even_where_tokens_tie():
    """``--top-k 1`` drew among the tokens tied with the best (top-k keeps ties); llama.cpp's keeps one,
    and users take it for greedy: it is greedy (the first of tied tokens, at any seed)."""
    logits = torch.tensor([1.0, 3.0, 0.5, 3.0])
    params = SamplingParams(temperature=1.0, top_k=1)
    params.validate()
    assert params.temperature == 0
    draws = {sample(logits, params, torch.tensor([]), torch.Generator().manual_seed(s)) for s in range(50)}
    assert draws == {1}


@pytest.mark.parametrize(
    "args,message",
    [
        (["-f", "prompt.txt"], "--prompt or --prompt-file, not both"),
        (["--stop", ""], "a stop text is empty"),
        (["--dtype", "foo"], "unknown dtype 'foo'"),  # (it was said after the model had loaded)
        (["--ctx", "32", "--system", "word " * 40], "the system prompt is "),
    ],
)
def test_generate_refuses_before_guessing(tiny_dir, tmp_path, monkeypatch, args, message):
    """-p and -f together (the file was ignored), an empty stop text (never matched), a system prompt
    longer than --ctx (said as "--keep", an option not given): one line each, exit 2."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompt.txt").write_text("from a file")
    r = invoke("generate", "-m", str(tiny_dir), "-p", "hi", "-n", "1", *args)
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith(("converting ", "compiling the "))]
    assert r.exit_code == 2 and len(lines) == 1 and message in lines[0], r.output


def test_interrupt_while_the_prompt_is_read_prints_the_summary(tiny_dir, monkeypatch):
    """Ctrl-C (or SIGTERM) before the first token ended on the progress bar with nothing said; now the
    summary line says how much of the prompt was read, and a long prompt is said to outgrow --ctx."""
    from selfextend.generation import generator

    def interrupted(gen, ids, max_new_tokens, eos, reused, reused_logits, progress):
        gen.feed(ids[:20], progress=progress)
        raise KeyboardInterrupt
        yield  # a generator, as run is

    monkeypatch.setattr(generator, "run", interrupted)
    r = invoke("generate", "-m", str(tiny_dir), "--no-chat", "-p", "word " * 100, "--ctx", "64")
    assert r.exit_code == 130, r.output  # as the shell's for a Ctrl-C, so a script sees the stop
    assert "the prompt's 101 tokens are more than --ctx 64 cells" in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("0 tokens in ") and "stopped: interrupted while reading the prompt (20 of 101" in last
    )
    assert ", prompt 20 tokens in " in last  # those read, not the whole prompt's count


def test_a_closed_standard_output_stops_with_its_reason_and_141(tiny_dir, tmp_path):
    """``generate ... | head -c 20``: the run stops, says why in its summary on stderr, and exits 141 as a
    writer killed by SIGPIPE does (it stopped without a word, exit 1: a script saw a failure of nothing
    it could name); the --output file keeps what was written."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out.txt"
    args = ["-m", "selfextend", "generate", "-m", str(tiny_dir), "-p", "hi", "-n", "2000", "--ignore-eos"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, *args, "--no-chat", "-o", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    first = proc.stdout.read(20)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert len(first) == 20 and "stopped: standard output was closed" in err and "Traceback" not in err, err
    assert out.read_bytes().startswith(first)


def test_a_template_start_too_long_for_ctx_is_named_as_such(tmp_path):
    """No --system given, the chat template writes its own default system block: the refusal named it
    "the system prompt", which the user never gave."""
    r = invoke("generate", "-p", "hi", "-n", "1", "--ctx", "16")
    said = "the chat template's own start (its default system prompt"
    assert r.exit_code == 2 and said in r.stderr, r.output


def test_keep_counts_prompt_tokens_at_most(tiny_dir):
    """--keep past the prompt's length kept generated tokens too; as llama.cpp's (and our server's
    n_keep), it is at most the prompt: the text and the shifts (more, with more kept) are --keep -1's."""
    args = ["generate", "-m", str(tiny_dir), "--no-chat", "-p", "one two three", "-n", "80", "--ignore-eos"]
    args += ["--temperature", "0"]
    texts = [invoke(*args, "--ctx", "32", "--keep", keep) for keep in ("-1", "20")]
    assert all(r.exit_code == 0 for r in texts), texts[0].output
    shifts = [r.stderr.strip().splitlines()[-1].split(" context shifts")[0].rsplit(" ", 1)[-1] for r in texts]
    assert texts[0].stdout == texts[1].stdout and shifts[0] == shifts[1] and int(shifts[0]) >= 2, shifts


def test_an_unwritable_output_file_is_named_and_the_run_stops(tiny_dir):
    """``-o`` on a full disk said "[Errno 28] No space left on device", naming no file; now the summary
    says the run stopped for it and the error names the file; standard output keeps the text."""
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    r = invoke("generate", "-m", str(tiny_dir), "--no-chat", "-p", "hi", "-n", "50", "-o", "/dev/full")
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1 and lines[-1] == "error: cannot write /dev/full: No space left on device", lines
    assert lines[-2].endswith("stopped: /dev/full could not be written") and r.stdout.strip()


def test_a_full_standard_output_is_named_and_exits_1(tiny_dir):
    """``generate > /dev/full`` said "[Errno 28] No space left on device" with exit 2 (a usage error) and
    no summary: named as -o's file is, the summary printed, exit 1."""
    import os
    import subprocess
    import sys

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    args = ["-m", "selfextend", "generate", "-m", str(tiny_dir), "--no-chat", "-p", "hi", "-n", "20"]
    with open("/dev/full", "w") as full:
        r = subprocess.run(
            [sys.executable, *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and lines[-1] == "error: cannot write standard output: No space left on device"
    assert lines[-2].endswith("stopped: standard output could not be written") and "Traceback" not in r.stderr


def test_no_tokens_print_no_blank_line_and_the_first_rate_is_null(tiny_dir):
    """-n 0 printed an empty line; --stats-every 1 said 0 tokens/s for the first token (made with the
    prompt, no interval of its own): null."""
    base = ["generate", "-m", str(tiny_dir), "--no-chat", "-p", "hi"]
    assert invoke(*base, "-n", "0").stdout == ""
    r = invoke(*base, "-n", "3", "--ignore-eos", "--stats-every", "1")
    rates = [json.loads(x)["tokens_per_s"] for x in r.stderr.splitlines() if x.startswith("{")]
    assert rates[0] is None and len(rates) == 3 and all(x > 0 for x in rates[1:]), r.stderr


def test_library_misuse_is_refused_in_words(tiny):
    """What a researcher's first tries met: a list as logit_bias (AttributeError), a tokenizer's whole
    output or a batch of one as ids (told "too many dimensions 'str'", "2-D"), a Generator over a cache a
    forward of their own filled (its stats then counted cells it never wrote), a GPT-2 draft model (refused
    only at the first run), a CUDA cache on a torch without one (torch's AssertionError)."""
    from transformers import BatchEncoding, GPT2Config, GPT2LMHeadModel

    from selfextend.generation.draft import DraftModel
    from selfextend.generation.generator import Generator, run
    from selfextend.hf.facts import ModelError
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models.blocks import TokenIdError

    model, _ = tiny
    with pytest.raises(ValidationError, match="must map token ids to biases .* got a list"):
        SamplingParams(logit_bias=[1, 2]).validate()
    gen = Generator(model, ContextShiftCache(model, 64, 4))
    with pytest.raises(TokenIdError, match=r"pass its \.input_ids"):
        list(run(gen, BatchEncoding({"input_ids": [1, 2, 3]}), 2))
    with pytest.raises(TokenIdError, match=r"a batch of one: pass its row \[0\]"):
        list(run(gen, torch.tensor([[1, 2, 3]]), 2))
    assert len(list(run(gen, [1, 2, 3], 2))) == 2
    with pytest.raises(ValidationError, match="holds 5 cells and tokens= names 0"):
        Generator(model, gen.cache)
    assert Generator(model, gen.cache, tokens=list(gen.tokens)).tokens == gen.tokens
    with pytest.raises(ModelError, match="no rotary position embeddings"):
        DraftModel(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)))
    if not torch.cuda.is_available():
        with pytest.raises(ValidationError, match="cuda is not available here"):
            ContextShiftCache(model, 64, device="cuda")


def test_a_piped_turns_last_newline_is_not_part_of_it(tiny):
    """``echo "Say hello." | generate`` read "Say hello.\\n" and got another reply than ``-p "Say hello."``:
    a chat turn's trailing line breaks are dropped; a plain prompt keeps them (its text goes on below)."""
    from selfextend.generation.text import build_prompt

    _, tok = tiny
    assert build_prompt(tok, "Say hello.\n") == build_prompt(tok, "Say hello.")
    assert build_prompt(tok, "Say hello.\r\n\n", "Be brief.") == build_prompt(tok, "Say hello.", "Be brief.")
    assert build_prompt(tok, "Say hello.\n", chat=False) != build_prompt(tok, "Say hello.", chat=False)

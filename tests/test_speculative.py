"""Speculative greedy decoding by prompt lookup (generation/speculative.py): drafted tokens checked in one
pass give plain greedy decoding's tokens exactly, through context shifts and with Self-Extend, and leave
the cache as plain decoding leaves it; drafts that repeat the context are accepted."""

from __future__ import annotations

import re

import pytest
import torch
from test_models import write_tiny_gguf

from selfextend.generation import generator, speculative
from selfextend.generation.draft import DraftModel
from selfextend.generation.generator import Generator, run
from selfextend.generation.sampling import SamplingParams
from selfextend.generation.speculative import DraftOdds, lookup_draft
from selfextend.hf.patch import apply_self_extend, remove_self_extend
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model
from selfextend.native.quant import quant_kernels

pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernels")
REPEATED = [5, 9, 11, 13, 17, 19, 23] * 4  # a prompt a lookup drafts from


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """A tiny Q8_0 GGUF as blocks (the batch-invariant products the check needs)."""
    path = write_tiny_gguf(
        tmp_path_factory.mktemp("spec") / "t.gguf", hidden=256, heads=4, kv_heads=2, quant="Q8_0"
    )
    return load_model(str(path), weights="gguf")[0]


def test_the_lookup_drafts_what_followed_the_tail() -> None:
    assert lookup_draft([1, 2, 3, 4, 9, 2, 3], 2) == [4, 9]  # "2 3" seen before, then 4 9
    assert lookup_draft([1, 2, 3, 4, 9, 2, 3], 5) == [4, 9, 2, 3]
    assert lookup_draft([7, 8, 9], 3) == []  # nothing repeats
    assert lookup_draft([1, 2, 1], 0) == [] and lookup_draft([1], 4) == []


def _greedy(model, lookup: int, n_ctx: int, tokens: int, prompt: list[int], draft=None, **kw):
    gen = Generator(
        model,
        ContextShiftCache(model, n_ctx, n_keep=4),
        SamplingParams(temperature=0),
        lookup=lookup,
        draft=draft,
    )
    out = [t for t, _ in run(gen, prompt, tokens, **kw)]
    return out, gen


def assert_same_cells(g1: Generator, g2: Generator) -> None:
    """Every layer's cells hold the same keys and values, bit for bit (with Self-Extend, a grouped key
    rotated from a drafted row's cell before the call wrote it once differed in the last bits)."""
    n = g1.cache.n_past
    for a, b in zip(g1.cache.layers, g2.cache.layers, strict=True):
        assert torch.equal(a.keys[..., :n, :], b.keys[..., :n, :])
        assert torch.equal(a.values[..., :n, :], b.values[..., :n, :])


@pytest.mark.parametrize("self_extend", [False, True], ids=["plain", "self-extend"])
def test_speculative_greedy_is_plain_greedy_through_shifts(model, self_extend: bool) -> None:
    if self_extend:
        apply_self_extend(model, 2, 8)
    try:
        for n_ctx, tokens in ((48, 120), (200, 60), (48, 20)):  # 48 cells: several shifts
            plain, g1 = _greedy(model, 0, n_ctx, tokens, REPEATED)
            fast, g2 = _greedy(model, 6, n_ctx, tokens, REPEATED)
            assert fast == plain
            assert g2.cache.shifts == g1.cache.shifts and (n_ctx > 100 or tokens < 30 or g1.cache.shifts >= 2)
            assert g2.tokens == g1.tokens and g2.cache.n_past == g1.cache.n_past
            assert torch.equal(g2.last_logits, g1.last_logits)  # the cache left as plain decoding leaves it
            assert_same_cells(g1, g2)
    finally:
        remove_self_extend(model)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """A smaller draft of the tiny model's vocabulary (other weights: it drafts some tokens wrong)."""
    path = write_tiny_gguf(
        tmp_path_factory.mktemp("draft") / "d.gguf", layers=1, hidden=64, heads=2, kv_heads=1, quant="Q8_0"
    )
    return load_model(str(path), weights="gguf")[0]


class Wrong(DraftModel):
    """A draft model whose every third draft is another token (two tiny random models agree too well)."""

    proposed = 0  # drafts proposed by every instance (a server slot's is a copy)

    def propose(self, context, n, cache, sampling, rng):
        drafts, q = super().propose(context, n, cache, sampling, rng)
        Wrong.proposed += len(drafts)
        return [t if (len(context) + i) % 3 else 4 + t % 50 for i, t in enumerate(drafts)], q


def assert_plain_greedy_with(draft: DraftModel, model: torch.nn.Module, self_extend: bool) -> Generator:
    """Greedy decoding of REPEATED through 48 cells with ``draft``'s drafts (both models Self-Extended where
    asked) gives plain greedy's tokens, shifts (2 or more), last logits and cells; its generator."""
    models = (model, draft.model)
    if self_extend:
        for m in models:
            apply_self_extend(m, 2, 8)
    try:
        plain, g1 = _greedy(model, 0, 48, 120, REPEATED)
        fast, g2 = _greedy(model, 0, 48, 120, REPEATED, draft=draft)
    finally:
        for m in models:
            remove_self_extend(m)
    assert fast == plain and g1.cache.shifts >= 2 and g2.cache.shifts == g1.cache.shifts
    assert g2.tokens == g1.tokens and torch.equal(g2.last_logits, g1.last_logits)
    assert_same_cells(g1, g2)
    return g2


@pytest.mark.parametrize("self_extend", [False, True], ids=["plain", "self-extend"])
def test_a_draft_model_gives_plain_greedy_through_shifts(model, small, self_extend: bool) -> None:
    """Drafts from another model (its cache following the target's shifts): the tokens, shifts and cache
    of plain greedy decoding; some drafts kept, some refused."""
    seen = []
    real = speculative.choose
    watch = lambda gen, logits, draft, q: seen.append((draft, real(gen, logits, draft, q))) or seen[-1][1]  # noqa: E731
    draft = Wrong(small, 4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(speculative, "choose", watch)
        assert_plain_greedy_with(draft, model, self_extend)
    drafted = [(d, t) for d, t in seen if d is not None]
    assert any(d == t for d, t in drafted) and any(d != t for d, t in drafted)
    assert draft.gen.cache.shifts >= 2  # it followed the target's shifts rather than refilling


class Tempting(DraftModel):
    """A draft model whose scores favour the ids past 262 (the tiny target's table) at every proposal."""

    def _catch_up(self, gen, context, logits=True, chunk=None):
        if not logits:  # the target's cells before its shift, written without scores
            return super()._catch_up(gen, context, logits, chunk)
        logits = super()._catch_up(gen, context, chunk=chunk).clone()
        logits[262:] += 1e4
        return logits


def _tiny(path, **kw) -> torch.nn.Module:
    return load_model(str(write_tiny_gguf(path, quant="Q8_0", **kw)), weights="gguf")[0]


def test_a_draft_table_padded_longer_never_reaches_past_the_targets(model, tmp_path) -> None:
    """A draft of 270 ids (8 more at the end, a table padded as llama.cpp allows) for the 262 of the target,
    its scores pulled past 262: its drafts are drawn over the target's ids alone (none past its table, which
    the target's step would have read past), and greedy decoding is plain greedy through shifts."""
    draft = Tempting(_tiny(tmp_path / "d.gguf", layers=1, hidden=64, heads=2, kv_heads=1, extra_tokens=8), 4)
    seen = []
    real = speculative.choose
    watch = lambda gen, logits, d, q: seen.append(d) or real(gen, logits, d, q)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(speculative, "choose", watch)
        assert_plain_greedy_with(draft, model, self_extend=False)
    drafted = [d for d in seen if d is not None]
    assert draft.rows == 270 and draft.ids == 262 and drafted and max(drafted) < 262


def test_a_target_table_padded_longer_reaches_the_draft_as_id_0(small, tmp_path) -> None:
    """A target of 270 ids drafted by a model of 262: a prompt holding the target's ids 265 and 268 (which
    the draft's table lacks) decodes as plain greedy, the draft reading them as 0."""
    target = _tiny(tmp_path / "t.gguf", hidden=256, heads=4, kv_heads=2, extra_tokens=8)
    prompt = [*REPEATED[:10], 265, 268, *REPEATED[10:]]
    plain, _ = _greedy(target, 0, 200, 60, prompt)
    draft = DraftModel(small, 4)
    fast, g = _greedy(target, 0, 200, 60, prompt, draft=draft)
    assert fast == plain and draft.ids == 270 and draft.rows == 262
    assert draft.gen.tokens[10:12] == [0, 0] and g.drafted > 0


def test_tables_more_than_128_ids_apart_are_refused(model, tmp_path) -> None:
    far = _tiny(tmp_path / "far.gguf", layers=1, hidden=64, heads=2, kv_heads=1, extra_tokens=129)
    with pytest.raises(ValueError, match="391 token ids, the target 262: not the same vocabulary"):
        Generator(model, ContextShiftCache(model, 48), draft=DraftModel(far))


class _Tokens:
    def __init__(self, tokens: list[str]) -> None:
        self.vocab, self.bos_token_id, self.eos_token_id = {t: i for i, t in enumerate(tokens)}, 1, 2

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


TOKENS = [f"t{i}" for i in range(300)]


@pytest.mark.parametrize(
    "draft,problem",
    [
        (TOKENS, None),
        (TOKENS + [f"[PAD{i}]" for i in range(128)], None),  # Qwen2.5-like padding
        (
            TOKENS + [f"[PAD{i}]" for i in range(129)],
            "(429 against 300 entries, up to 128 more at the end of one allowed; 0 of the 300",
        ),
        ([f"t{i}" for i in range(200)], None),  # the target the longer one, by 100
        (
            [f"t{i}" if i != 7 else "seven" for i in range(300)],
            "(300 against 300 entries, up to 128 more at the end of one allowed; 1 of the 300",
        ),
    ],
)
def test_vocabularies_compare_by_id_up_to_padding(draft: list[str], problem: str | None) -> None:
    from selfextend.generation.draft import vocabulary_problem

    got = vocabulary_problem(_Tokens(TOKENS), _Tokens(draft))
    assert got == problem if problem is None else problem in got


def test_drafts_are_accepted_and_passes_saved(model) -> None:
    """A model that repeats its context (greedy decoding of a tiny random model falls into a loop) takes
    drafts: fewer passes of the step than tokens."""
    passes = []
    gen = Generator(model, ContextShiftCache(model, 400), SamplingParams(temperature=0), lookup=8)
    rows = gen.step.rows
    gen.step.rows = lambda tokens, caches: passes.append(len(tokens)) or rows(tokens, caches)
    out = [t for t, _ in run(gen, REPEATED, 100)]
    plain, _ = _greedy(model, 0, 400, 100, REPEATED)
    assert out == plain
    assert len(passes) < 100 and max(passes) > 1


def test_it_stops_where_the_consumer_stops(model) -> None:
    """A consumer that takes 10 tokens leaves the cache holding the prompt and 9 of them, as plain."""
    for lookup in (0, 6):
        gen = Generator(model, ContextShiftCache(model, 200), SamplingParams(temperature=0), lookup=lookup)
        it = gen.decode(gen.feed(REPEATED), -1)
        got = [next(it) for _ in range(10)]
        it.close()
        assert gen.cache.n_past == len(REPEATED) + 9 and gen.tokens[len(REPEATED) :] == got[:9]


def test_without_a_batch_invariant_step_each_token_decodes_alone(model, caplog) -> None:
    """No direct decode step (the model run by transformers): plain decoding, said once; a negative count is
    refused."""
    gen = Generator(model, ContextShiftCache(model, 200), SamplingParams(temperature=0), lookup=4)
    gen.step = None
    plain, _ = _greedy(model, 0, 200, 20, REPEATED)
    generator._SAID.clear()  # said once per process: maybe already by another test here
    with caplog.at_level("WARNING"):
        assert [t for t, _ in run(gen, REPEATED, 20)] == plain
    assert "speculative decoding off (no batch-invariant decode step" in caplog.text
    with pytest.raises(ValueError, match="lookup"):
        Generator(model, ContextShiftCache(model, 200), lookup=-1)


@pytest.mark.parametrize("self_extend", [False, True], ids=["plain", "self-extend"])
def test_rejected_drafts_leave_no_cell(model, monkeypatch: pytest.MonkeyPatch, self_extend: bool) -> None:
    """Drafts greedy decoding never picks (every other one wrong): their cells are dropped, so the output,
    the shifts and the cache are plain decoding's."""
    import selfextend.generation.speculative as speculative

    real = speculative.lookup_draft
    calls = []

    def wrong(tokens, n, ngram=speculative.NGRAM):
        calls.append(n)
        got = real(tokens, n, ngram) or [3] * n
        return [t if i % 2 == 0 else 4 + t % 50 for i, t in enumerate(got)]

    monkeypatch.setattr(speculative, "lookup_draft", wrong)
    if self_extend:
        apply_self_extend(model, 2, 8)
    try:
        plain, g1 = _greedy(model, 0, 48, 80, REPEATED)
        fast, g2 = _greedy(model, 5, 48, 80, REPEATED)
    finally:
        remove_self_extend(model)
    assert fast == plain and len(calls) > 10 and g1.cache.shifts >= 2
    assert g2.cache.shifts == g1.cache.shifts and g2.tokens == g1.tokens
    assert torch.equal(g2.last_logits, g1.last_logits)


@pytest.mark.real
def test_the_default_model_copies_text_exactly_and_faster() -> None:
    """The default model asked to repeat a paragraph: speculative greedy output is plain greedy's token for
    token, in fewer passes than tokens."""
    from selfextend.generation.text import build_prompt

    model, tok = load_model("smollm2-135m", weights="gguf")  # the CLI's default on the CPU
    text = (
        "The lighthouse keeper climbed the stairs each evening, lit the lamp, and wrote the weather in "
        "his log: wind from the west, rain by midnight, a ship's lights far out past the reef."
    )
    ids, _ = build_prompt(tok, f"Repeat this text exactly:\n\n{text}")
    plain, _ = _greedy(model, 0, 512, 48, ids)
    gen = Generator(model, ContextShiftCache(model, 512, n_keep=4), SamplingParams(temperature=0), lookup=8)
    passes = []
    rows = gen.step.rows
    gen.step.rows = lambda tokens, caches: passes.append(len(tokens)) or rows(tokens, caches)
    fast = [t for t, _ in run(gen, ids, 48)]
    assert fast == plain
    assert len(passes) < 40, passes


@pytest.mark.real
def test_the_default_model_as_its_own_draft_keeps_every_draft_through_shifts() -> None:
    """The draft's cache makes each shift where the target made it (after writing the tokens the target
    held then), so an identical draft model drafts what the target takes, through shifts too. Mirrored one
    token late, the token written after a shift had not attended the dropped cells: 87 of 128 kept here."""
    from selfextend.generation.text import build_prompt

    model, tok = load_model("smollm2-135m", weights="gguf")
    ids, _ = build_prompt(tok, "Tell me a long story about a lighthouse keeper.")
    _, gen = _greedy(model, 0, 64, 120, ids, draft=DraftModel(model, 4))  # its tokens plain's: tests above
    assert gen.cache.shifts >= 3 and gen.drafted > 60 and gen.kept == gen.drafted
    # a prompt of a few tokens: the draft wrote them through its decode step's rows, the target through
    # its forward; the cells differed and near-ties flipped (69 of 86 kept)
    _, gen = _greedy(model, 0, 512, 80, tok("Once upon a time").input_ids, draft=DraftModel(model, 8))
    assert gen.drafted > 40 and gen.kept == gen.drafted


@pytest.fixture(scope="module")
def default_draft() -> Wrong:
    """The default model's float form drafting for its GGUF blocks (the same vocabulary; every third draft
    made wrong, so refusals are taken too)."""
    return Wrong(load_model("smollm2-135m", weights="float")[0], 6)


def _source(name: str, request: pytest.FixtureRequest) -> dict:
    """The keyword arguments of a draft source: prompt lookup, or the default model's draft."""
    Wrong.proposed = 0
    return {"lookup": 8} if name == "lookup" else {"draft": request.getfixturevalue("default_draft")}


@pytest.mark.real
@pytest.mark.parametrize(
    "source,stops", [("lookup", ()), ("draft model", ()), ("draft model", ("is deep",))]
)  # a stop with the lookup's drafts: the same path, and a minute of the suite
def test_chat_replies_are_the_same_with_drafts(source: str, stops: tuple[str, ...], request) -> None:
    """A greedy chat through context shifts gives the same replies with drafts as without, and holds the
    same tokens; with a stop string too (the drafts checked past it stayed in the cache, and later turns
    read them)."""
    from selfextend.chat.session import ChatSession

    model, tok = load_model("smollm2-135m", weights="gguf")
    turns = [
        "Repeat after me: the sea is wide and the sea is deep.",
        "Say it again, twice.",
        "Once more.",
        "And again.",
    ]
    replies = []
    for kw in ({}, _source(source, request)):
        chat = ChatSession(
            model,
            tok,
            96,  # a shift at the fourth turn
            system="You are terse.",
            sampling=SamplingParams(temperature=0),
            max_new_tokens=60,
            stops=stops,
            **kw,
        )
        replies.append(["".join(chat.reply(t)) for t in turns])
        shifts = chat.cache.shifts
        held = chat.gen.tokens
        if kw == {}:
            plain_held = held
    assert replies[0] == replies[1] and held == plain_held and shifts >= 1
    assert not stops or any(r.endswith("the sea ") for r in replies[0]), replies[0]  # cut where it stops
    # drafts checked, some kept and some refused (how many depends on the replies' lengths, which depend on
    # the CPU's products: 39 drafts on an AVX2-only EPYC, past 50 on an AVX-512 Xeon)
    drafted, kept = chat.gen.drafted, chat.gen.kept
    assert 0 < kept < drafted and (source == "lookup" or Wrong.proposed == drafted), (drafted, kept)


def _replies(engine, prompts: list[list[int]], max_tokens: int, stops=(), ignore_eos=False) -> list[str]:
    """The greedy replies of ``prompts`` submitted at once (the slots decode together)."""
    from selfextend.server.jobs import Job, Reply

    replies = [Reply() for _ in prompts]
    for reply, p in zip(replies, prompts, strict=True):
        greedy = SamplingParams(temperature=0)
        engine.submit(Job(list(p), 0, greedy, max_tokens, reply.emit, stops=stops, ignore_eos=ignore_eos))
    got = [reply.wait(300) for reply in replies]
    assert all(last["type"] == "done" for _, last in got), got
    return [text for text, _ in got]


@pytest.mark.real
@pytest.mark.parametrize("source", ["lookup", "draft model"])
def test_two_server_slots_reply_the_same_with_drafts(source: str, request: pytest.FixtureRequest) -> None:
    """Two slots decoding together, each drafting, through a context shift: their greedy replies
    (and a stop string's cut) are those of the server without drafts, and the next requests on the same
    slots, reusing their caches, too."""
    from selfextend.generation.text import build_prompt
    from selfextend.server.engine import Engine

    model, tok = load_model("smollm2-135m", weights="gguf")
    texts = [
        "Repeat this text exactly: the keeper lit the lamp and wrote the weather in his log.",
        "Copy this list twice: red, green, blue, yellow, purple, orange.",
    ]
    prompts = [build_prompt(tok, t)[0] for t in texts]
    got = []
    for kw in ({}, _source(source, request)):
        engine = Engine(model, tok, 96, parallel=2, **kw)
        engine.start()
        try:
            first = _replies(engine, prompts, 80, ignore_eos=True)  # past the 96 cells: a shift
            cut = _replies(engine, prompts, 60, stops=("lamp", "blue"))
            got.append((first, cut, [s.gen.cache.shifts for s in engine.slots]))
        finally:
            engine.stop()
    assert got[0] == got[1]
    assert any(n >= 1 for n in got[0][2])  # a shift on the way
    assert source == "lookup" or Wrong.proposed > 50


def test_generate_with_a_draft_model_prints_plain_greedy_text(tmp_path, cache) -> None:
    """``generate --draft-model`` (two tiny GGUFs of one vocabulary) prints what plain greedy decoding
    prints, and so with its draft scoring part of the vocabulary or holding 8 ids more (a table padded as
    llama.cpp allows, up to 128); a draft of another vocabulary (200 ids more), two sources
    of drafts, or a draft vocabulary without a draft model or of no ids, is refused in one line."""
    from click.testing import CliRunner

    from selfextend.cli.main import main

    target = write_tiny_gguf(tmp_path / "t.gguf", hidden=256, heads=4, kv_heads=2, quant="Q8_0")
    draft = write_tiny_gguf(tmp_path / "d.gguf", layers=1, hidden=64, heads=2, kv_heads=1, quant="Q8_0")
    padded = write_tiny_gguf(tmp_path / "p.gguf", layers=1, hidden=64, quant="Q8_0", extra_tokens=8)
    other = write_tiny_gguf(tmp_path / "o.gguf", quant="Q8_0", extra_tokens=200)

    def generate(*extra):
        args = ["generate", "-m", target, "--weights", "gguf", "-p", "the the the", "-n", "100"]
        args += ["--temperature", "0", "--ctx", "48", "--ignore-eos", *extra]
        return CliRunner().invoke(main, [str(a) for a in args])

    plain, drafted = generate(), generate("--draft-model", draft, "--draft-max", "4")
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.stderr
    assert drafted.stdout == plain.stdout
    part = generate("--draft-model", draft, "--draft-max", "4", "--draft-vocab", "64")  # 64 of 262 ids
    assert part.exit_code == 0 and part.stdout == plain.stdout, part.stderr
    longer = generate("--draft-model", padded, "--draft-max", "4")  # 270 ids: 8 of padding past the 262
    assert longer.exit_code == 0 and longer.stdout == plain.stdout, longer.stderr
    assert int(re.search(r"(\d+) context shifts", drafted.stderr).group(1)) >= 2
    kept, tried = map(int, re.search(r"drafts kept (\d+)/(\d+)", drafted.stderr).groups())
    assert 0 < kept <= tried and "drafts kept" not in plain.stderr
    for extra, says in (
        (("--draft-model", other), "the draft model's vocabulary differs from the target's (462 against 262"),
        (("--draft-model", draft, "--lookup", "4"), "choose one source of drafts"),
        (
            (
                "--draft-vocab",
                "64",
            ),
            "--draft-vocab needs --draft-model",
        ),
        (("--draft-model", draft, "--draft-vocab", "0"), "0 is not in the range x>=1"),
    ):
        r = generate(*extra)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
        assert r.exit_code == 2 and len(errors) == 1 and says in errors[0], r.stderr


@pytest.mark.real
def test_a_request_sets_its_drafts_over_http() -> None:
    """Through the real ``openai`` client on a loopback socket: a server with ``--lookup 8`` reports the
    drafts it checked and kept (llama-server's ``draft_n``, ``draft_n_accepted``); a request with
    ``speculative.n_max: 0`` (or nested, ``speculative: {n_max: 0}``) takes none and gets the same greedy
    reply; a negative one is a 400."""
    import openai
    from server_util import serving

    model, tok = load_model("smollm2-135m", weights="gguf")
    text = "Repeat this text exactly: the keeper lit the lamp and wrote the weather in his log."
    with serving(model, tok, n_ctx=256, lookup=8) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        asked = dict(model="m", messages=[{"role": "user", "content": text}], max_tokens=40, temperature=0)
        drafted = client.chat.completions.create(**asked)
        alone = client.chat.completions.create(**asked, extra_body={"speculative.n_max": 0})
        nested = client.chat.completions.create(**asked, extra_body={"speculative": {"n_max": 0}})
        with pytest.raises(openai.BadRequestError, match="speculative.n_max"):
            client.chat.completions.create(**asked, extra_body={"speculative.n_max": -1})
    ours, theirs = drafted.model_extra["selfextend"], alone.model_extra["selfextend"]
    assert drafted.choices[0].message.content == alone.choices[0].message.content
    assert 0 < ours["draft_n_accepted"] <= ours["draft_n"] and theirs["draft_n"] == 0
    assert nested.model_extra["selfextend"]["draft_n"] == 0  # the nested spelling is the same field
    assert nested.choices[0].message.content == alone.choices[0].message.content


@pytest.mark.real
def test_a_response_format_holds_with_drafts() -> None:
    """A JSON schema's mask applies to drafted tokens as to any: greedy output with lookup is plain's, and
    drafts were kept (the default model)."""
    from selfextend.generation.grammar import Grammar
    from selfextend.generation.text import build_prompt, eos_token_ids

    model, tok = load_model("smollm2-135m", weights="gguf")
    tags = {"type": "array", "items": {"type": "string"}}
    schema = {
        "type": "object",
        "properties": {"tags": tags},
        "required": ["tags"],
        "additionalProperties": False,
    }
    ids, _ = build_prompt(tok, "Tom the cat as JSON with tags cute, fluffy, cute, fluffy, cute, fluffy.")
    outs = []
    for lookup in (0, 8):
        gen = Generator(model, ContextShiftCache(model, 256), SamplingParams(temperature=0), lookup=lookup)
        gen.grammar = Grammar(tok, schema, eos_token_ids(model, tok))
        outs.append([t for t, _ in run(gen, ids, 60)])
    assert outs[0] == outs[1] and gen.kept > 10
    assert tok.decode(outs[0]).replace(" ", "").startswith('{"tags":["')  # what the schema allows


def test_more_rows_of_a_cache_than_the_window_are_exact(model) -> None:
    """Seven rows of one cache with Self-Extend's W = 4: the rows past W would group cells the one native
    call writes, so the step takes them row by row; the logits and cells are those of seven lone steps, and
    lookup drafts at most W - 1 tokens a pass."""
    apply_self_extend(model, 2, 4)
    try:
        gens = [
            Generator(model, ContextShiftCache(model, 64), SamplingParams(temperature=0)) for _ in range(2)
        ]
        for gen in gens:
            gen.feed(REPEATED)
        seq = [5, 9, 11, 13, 17, 19, 23]
        together = gens[0].step.rows(seq, [gens[0].cache] * len(seq))
        alone = torch.stack([gens[1].step(t, gens[1].cache) for t in seq])
        assert torch.equal(together, alone)
        gens[0].tokens += seq
        gens[1].tokens += seq
        assert_same_cells(gens[0], gens[1])
        assert gens[0].step.most_rows() == 4
        fast, _ = _greedy(model, 8, 64, 30, REPEATED)
        plain, _ = _greedy(model, 0, 64, 30, REPEATED)
        assert fast == plain
    finally:
        remove_self_extend(model)


def test_draft_odds_ask_for_the_drafts_that_pay() -> None:
    """A fresh count asks for the most drafts; checks that keep none bring it to none; steps without a
    check bring it back to trying; the odds of a step over two sequences ask for fewer than over one."""
    odds = DraftOdds()
    assert odds.worth(8) == 8
    for _ in range(10):
        odds.seen(max(1, odds.worth(8)), 0)
    assert odds.worth(8) == 0
    waited = 0
    while odds.worth(8) == 0 and waited < 50:
        odds.seen(0, 0)
        waited += 1
    assert 1 <= waited <= 10 and odds.worth(8) >= 1
    some = DraftOdds(kept=3.0, refused=1.0)  # 0.7 a draft
    assert some.worth(8) > some.worth(8, sequences=2) >= 1
    assert some.worth(2) == 2 and DraftOdds().worth(0) == 0


@pytest.mark.real
def test_a_request_without_drafts_leaves_the_draft_model_idle(default_draft) -> None:
    """On a server with a draft model, a request with ``speculative.n_max: 0`` is decoded without it: the
    draft model reads none of its prompt; the next request that drafts catches its cache up and gets the
    reply of a server without drafts."""
    from selfextend.generation.text import build_prompt
    from selfextend.server.engine import Engine
    from selfextend.server.jobs import Job, Reply

    model, tok = load_model("smollm2-135m", weights="gguf")
    prompt = build_prompt(tok, "Repeat this text exactly: the keeper lit the lamp and wrote the weather.")[0]

    def ask(engine: Engine, draft_max: int | None) -> str:
        reply = Reply()
        engine.submit(
            Job(list(prompt), 0, SamplingParams(temperature=0), 30, reply.emit, draft_max=draft_max)
        )
        text, last = reply.wait(300)
        assert last["type"] == "done", last
        return text

    plain = Engine(model, tok, 256, parallel=1)
    plain.start()
    try:
        want = ask(plain, None)
    finally:
        plain.stop()
    engine = Engine(model, tok, 256, parallel=1, draft=default_draft)
    engine.start()
    try:
        drafts = engine.slots[0].draft
        assert ask(engine, 0) == want
        assert drafts.gen is None and engine.slots[0].gen.drafted == 0  # never asked to read or draft
        assert ask(engine, None) == want
        assert drafts.gen is not None and engine.slots[0].gen.drafted > 0
    finally:
        engine.stop()


def test_a_check_past_a_sliding_rings_end_is_each_row_alone(tmp_path) -> None:
    """Gemma 3's sliding layers (window 8, rings of 18 cells), Q8_0 blocks: five rows of one cache checked in
    one pass where the ring fills after two of them give each row's logits as stepping it alone, and a cut
    back to the first row is exact. The rows used to be claimed one by one with the ring compacted at the
    third's claim: the cells moved under the first rows' queries, and cells a cut back to them attends were
    dropped (recomputed then by a forward: other bits; a real Gemma 3's greedy text parted after ~900
    tokens)."""
    import gguf_write
    import transformers as tf
    from conftest import COMMON

    torch.manual_seed(0)
    gemma = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8)
    original = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 6}, **gemma)).eval()
    path = gguf_write.write(original, original.config, tmp_path / "g.gguf", file_type="Q8_0")
    model = load_model(str(path), weights="gguf")[0]
    tokens = [5, 9, 11, 13, 17]

    def prepared() -> Generator:
        gen = Generator(model, ContextShiftCache(model, 64, n_keep=4), SamplingParams(temperature=0))
        gen.feed([3, 4, 6, 7])
        for t in range(20, 32):  # one token a step: the sliding rings hold 16 of their 18 cells
            gen.feed([t])
        assert [layer.n_used for layer in gen.cache.layers[:5]] == [16] * 5
        return gen

    together = prepared()
    base = together.cache.n_past
    together.make_room(len(tokens))
    rows = together.step.rows(tokens, [together.cache] * len(tokens))
    alone = prepared()
    for t, row in zip(tokens, rows, strict=True):
        assert torch.equal(alone.feed([t]), row)
    assert together.cache.can_truncate(base + 1)


def test_chat_says_the_drafts_kept_as_generate_does(tmp_path) -> None:
    """A probe's find: generate's closing line said "drafts kept", chat's (and /stats) never did."""
    from click.testing import CliRunner

    from selfextend.cli.main import main

    target = write_tiny_gguf(tmp_path / "t.gguf", hidden=256, heads=4, kv_heads=2, quant="Q8_0")
    args = ["chat", "-m", str(target), "--weights", "gguf", "--temperature", "0", "-n", "24", "--ignore-eos"]
    said = "the the the the the the the the"
    r = CliRunner().invoke(main, [*args, "--lookup", "3"], input=f"{said}\n/stats\n")
    assert r.exit_code == 0, r.output
    counted = [x for x in r.stderr.splitlines() if "drafts kept" in x]
    assert len(counted) == 2, r.stderr  # /stats and the closing line
    kept, drafted = map(int, re.search(r"drafts kept (\d+)/(\d+)", counted[-1]).groups())
    assert 0 <= kept <= drafted and drafted > 0
    plain = CliRunner().invoke(main, args, input=f"{said}\n")
    assert plain.exit_code == 0 and "drafts kept" not in plain.stderr, plain.output


def test_a_prompt_read_from_a_prompt_cache_is_read_by_the_draft_with_it(model) -> None:
    """A whole prompt from --prompt-cache: the draft model read it at its first draft, so its seconds went
    to the reply's rate (0.17 tokens/s for the second token) and the prompt said 0.0 s; now it is read as
    the prompt is, before the first token."""
    prompt = list(range(5, 45))
    plain = Generator(model, ContextShiftCache(model, 96, n_keep=4))
    plain.feed(prompt)
    draft = DraftModel(model, 4)
    gen = Generator(model, plain.cache, tokens=list(plain.tokens), draft=draft)
    tokens = run(gen, prompt, 8, reused=len(prompt), reused_logits=plain.last_logits)
    next(tokens)
    assert draft.gen is not None and draft.gen.tokens == prompt

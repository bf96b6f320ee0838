"""A draft model scoring part of the vocabulary (generation/draft_vocab.py): the ids it scores get the
full head's logits, the others -inf, and a draft pair with it still decodes plain greedy's tokens (the
target's check decides), through shifts, with Self-Extend, and in a server's slots sharing one head."""

from __future__ import annotations

import pytest
import torch
from test_models import write_tiny_gguf
from test_speculative import REPEATED, assert_plain_greedy_with

from selfextend.generation.draft import DraftModel
from selfextend.generation.draft_vocab import HELD_MOST, PartialHead
from selfextend.generation.products import product_of
from selfextend.models import load_model
from selfextend.models.quantize import quantize_int8
from selfextend.native.quant import quant_kernels

pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="no C compiler here to build the kernels")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Q8_0 target and a smaller draft of its vocabulary (264 ids: an interleaved head)."""
    root = tmp_path_factory.mktemp("draftvocab")
    target = write_tiny_gguf(root / "t.gguf", hidden=256, heads=4, kv_heads=2, quant="Q8_0", extra_tokens=2)
    draft = write_tiny_gguf(
        root / "d.gguf", layers=1, hidden=64, heads=2, kv_heads=1, quant="Q8_0", extra_tokens=2
    )
    return load_model(str(target), weights="gguf")[0], load_model(str(draft), weights="gguf")[0]


@pytest.mark.parametrize("form", ["gguf", "float"])
@pytest.mark.parametrize("extra", [0, 2], ids=["stored rows", "interleaved rows"])
def test_it_scores_the_first_ids_and_the_held_ones(tmp_path, form: str, extra: int) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", hidden=64, quant="Q8_0", extra_tokens=extra)
    head = load_model(str(path), weights=form)[0].lm_head
    part = PartialHead(head, 13)  # rounded up to 16
    assert part.n == 16 and part.vocab == head.out_features
    x = torch.randn(3, 64)
    full = product_of((head,), logits=True)(x).float()  # the decode step's product of the whole head
    context = [3, 200, 7, 250, 200, part.vocab - 1]
    part.hold(context)
    got = part(x).float()
    scored = sorted({*range(16), 200, 250, part.vocab - 1})
    assert torch.equal(got[:, :16], full[:, :16])  # the head's own product over its first rows
    torch.testing.assert_close(got[:, scored], full[:, scored], atol=2e-2, rtol=1e-2)  # rows in float32
    others = torch.ones(part.vocab, dtype=torch.bool)
    others[scored] = False
    assert torch.isneginf(got[:, others]).all()
    assert part.ids.tolist() == [200, 250, part.vocab - 1]


def test_held_ids_are_bounded(tmp_path, monkeypatch) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", hidden=64, quant="Q8_0")
    part = PartialHead(load_model(str(path), weights="gguf")[0].lm_head, 8)
    monkeypatch.setattr("selfextend.generation.draft_vocab.HELD_MOST", 4)
    part.hold([100, 101, 102])
    part.hold([103])
    assert part.ids.tolist() == [100, 101, 102, 103]
    part.hold([104, 105])  # past the bound: this context's only
    assert part.ids.tolist() == [104, 105] and HELD_MOST >= 4096
    assert PartialHead(part_head := load_model(str(path), weights="gguf")[0].lm_head, 10**9).n == 262
    assert part_head.out_features == 262


@pytest.mark.parametrize("n", [0, -8, 1.5, "many"])
def test_a_bad_size_is_refused(pair, n) -> None:
    with pytest.raises(ValueError, match="draft vocabulary"):
        DraftModel(pair[1], 4, vocab=n)


def test_a_head_it_cannot_slice_is_refused(tmp_path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", hidden=64)
    model = load_model(str(path), weights="float")[0]
    quantize_int8(model)
    with pytest.raises(ValueError, match="GGUF block or float output layer, not Int8Linear"):
        DraftModel(model, 4, vocab=64)


@pytest.mark.parametrize("self_extend", [False, True], ids=["plain", "self-extend"])
def test_a_partial_draft_head_gives_plain_greedy_through_shifts(pair, self_extend: bool) -> None:
    """The tokens, shifts and cells of plain greedy decoding; the draft scores 64 of 264 ids and the
    context's, so it drafts some tokens and cannot draft others."""
    model, small = pair
    draft = DraftModel(small, 4, vocab=64)
    gen = assert_plain_greedy_with(draft, model, self_extend)
    assert draft.gen.step.head_product is draft.part and gen.kept > 0
    held = set(draft.part.ids.tolist())
    assert {t for t in REPEATED if t >= 64} <= held  # the prompt's ids past the first 64 are scored


@pytest.mark.real
def test_server_slots_share_one_partial_head_and_reply_the_same() -> None:
    """Two slots drafting from the default model's float form scoring 4,096 of its 49,152 ids: the replies
    of the server without drafts, one partial head for both slots."""
    from test_speculative import _replies

    from selfextend.generation.text import build_prompt
    from selfextend.server.engine import Engine

    model, tok = load_model("smollm2-135m", weights="gguf")
    draft = DraftModel(load_model("smollm2-135m", weights="float")[0], 6, vocab=4096)
    texts = ["Repeat this text exactly: the keeper lit the lamp and wrote the weather in his log."] * 2
    prompts = [build_prompt(tok, t)[0] for t in texts]
    got = []
    for kw in ({}, {"draft": draft}):
        engine = Engine(model, tok, 96, parallel=2, **kw)
        engine.start()
        try:
            got.append(_replies(engine, prompts, 60, ignore_eos=True))
            slots = [s.draft for s in engine.slots]
        finally:
            engine.stop()
    assert got[0] == got[1]
    assert all(s.part is draft.part for s in slots) and sum(s.gen is not None for s in slots) >= 1

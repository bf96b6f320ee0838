"""Drafts from a smaller model of the target's vocabulary (speculative decoding's draft model).

The draft model keeps a context-shift cache of its own, as large as the target's and keeping as many
tokens, held in step with the target's: before each proposal its cells are made the target's context
(the target's shifts mirrored, then the tokens that differ rewound and the new ones written), and it
writes its own drafts after them (rewound at the next proposal where the target kept fewer). So a draft
costs the draft model one token's step, not a prefill, except after a reply the target took elsewhere.

Why ours: transformers' assisted generation (``assistant_model``) runs on its growing ``DynamicCache``,
which our context shift and cells do not fit; llama.cpp's is C++. The rule that keeps the output
plain decoding's lives in :mod:`selfextend.generation.speculative`.

Two models of one tokenizer may have tables padded to other sizes (Qwen2.5 0.5B holds 151,936 rows, 7B
152,064); as llama.cpp, a draft may hold up to ``PAD_MOST`` ids more or fewer than the target. Its drafts
are then drawn over the target's ids alone (its scores past the target's table left out, those it lacks
-inf), so the target never reads an id past its table and a sampled check weighs two distributions of one
size; a target's id past the draft's table (a padding row drawn) reaches the draft's cache as id 0, which
only makes its drafts worse, never the output other than the target's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from selfextend.core.validate import ValidationError, check_int
from selfextend.generation.draft_vocab import PartialHead
from selfextend.generation.generator import Generator
from selfextend.generation.sampling import SamplingParams
from selfextend.generation.text import common_prefix
from selfextend.hf.facts import check_rope, require_model
from selfextend.kv.cache import ContextShiftCache

DRAFT_MAX = 16  # drafts asked for per pass by default: llama.cpp's --draft-max
FEW = 32  # tokens written to the draft's cache in one pass of its decode step, at most
PAD_MOST = 128  # token ids a draft's table may be longer or shorter than the target's: llama.cpp's bound
log = logging.getLogger(__name__)
_SAID: set[str] = set()  # warnings already given in this process


def vocabulary_problem(target: object, draft: object) -> str | None:
    """Why the draft tokenizer cannot draft for the target's, or None: the same token for every id both hold
    (compared id by id), at most ``PAD_MOST`` entries more in one (padding), and the same special tokens. A
    draft's ids are read as the target's, so any entry that differs would make drafts of other text (always
    refused, never a wrong output: the check keeps the output the target's, a mismatch only wastes passes)."""
    target_ids = {i: token for token, i in target.get_vocab().items()}
    draft_ids = {i: token for token, i in draft.get_vocab().items()}
    shared = target_ids.keys() & draft_ids.keys()
    differ = sum(target_ids[i] != draft_ids[i] for i in shared)
    if differ or abs(len(target_ids) - len(draft_ids)) > PAD_MOST:
        return (
            f"the draft model's vocabulary differs from the target's ({len(draft_ids)} against "
            f"{len(target_ids)} entries, up to {PAD_MOST} more at the end of one allowed; {differ} of the "
            f"{len(shared)} ids both hold are other tokens)"
        )
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(target, name, None) != getattr(draft, name, None):
            return f"the draft model's {name} differs from the target's"
    return None


class DraftModel:
    """A :class:`~selfextend.generation.speculative.Drafter` from ``model``: ``most`` drafts per pass, drawn
    under the target's sampling settings (greedy: the draft's argmax) from the target's random stream (one
    seed repeats a run); ``cache_dtype``: its cells' type (None: the model's). ``vocab``: the draft's output
    layer scores only the first ``vocab`` ids and the context's (:class:`PartialHead`; None: every id), in
    its direct decode step (said once where the model has none); ValueError for a head it cannot slice."""

    def __init__(
        self,
        model: nn.Module,
        most: int = DRAFT_MAX,
        cache_dtype: torch.dtype | None = None,
        vocab: int | PartialHead | None = None,
    ) -> None:
        require_model(model, "DraftModel")
        check_rope(model.config)  # ModelError for GPT-2 here, not at the first run that drafts
        self.model, self.most = model, check_int(most, "draft tokens per pass", 1)
        self.cache_dtype = cache_dtype
        self.part = (
            vocab if vocab is None or isinstance(vocab, PartialHead) else PartialHead(model.lm_head, vocab)
        )
        self.rows = rows_of(model)
        self.ids = self.rows  # the target's token ids (fit sets them): drafts are drawn over these
        self.gen: Generator | None = None
        self._target: ContextShiftCache | None = None
        self._discarded = 0  # the target's discarded cells the draft cache has mirrored

    def for_another(self) -> DraftModel:
        """A drafter of the same model and settings with a cache of its own (one per server slot)."""
        return type(self)(self.model, self.most, self.cache_dtype, self.part)  # one partial head for all

    def fit(self, target: nn.Module) -> None:
        """Draft for ``target``: ValidationError where its table is more than ``PAD_MOST`` ids from the
        draft's (another vocabulary); else drafts are drawn over the target's ids from here on."""
        ids = rows_of(target)
        if abs(ids - self.rows) > PAD_MOST:
            raise ValidationError(
                "draft",
                f"model has {self.rows:,} token ids, the target {ids:,}: not the same vocabulary (tables "
                f"of one tokenizer padded to other sizes may be up to {PAD_MOST} apart)",
            )
        self.ids = ids

    def _as_target(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits (rows,) over the target's ids (ids,): those past its table left out, those
        it lacks -inf."""
        if self.ids == self.rows:
            return logits
        if self.ids < self.rows:
            return logits[: self.ids]
        return torch.cat((logits, logits.new_full((self.ids - self.rows,), float("-inf"))))

    def _follow(self, target: ContextShiftCache, context: Sequence[int]) -> Generator:
        """The draft's generator with the target's shifts since the last proposal made in its cache too.

        A shift is made where the target made it: a token the target wrote before its shift attended the
        cells it then dropped, so the draft first writes the tokens the target held then (``context``, the
        target's tokens now, holds those it kept), then drops the same cells. Where more than one shift
        came between two proposals (a long turn), or the draft lacks the dropped tokens, it drops them
        where it stands: its cache then differs from the target's, which costs drafts, never tokens."""
        if self.gen is None or self._target is not target:
            cache = ContextShiftCache(self.model, target.n_ctx, target.n_keep, dtype=self.cache_dtype)
            self.gen = Generator(self.model, cache)
            self._target, self._discarded = target, target.discarded
            if self.part is not None:
                self._score_part(self.gen)
        gen, dropped = self.gen, target.discarded - self._discarded
        self._discarded = target.discarded
        keep = gen.cache.n_keep
        cached, last = target.last_shift
        if dropped and dropped == last and len(gen.tokens) >= keep + dropped:
            held = [*gen.tokens[: keep + dropped], *context[keep : cached - dropped]]  # the target's, then
            self._catch_up(gen, held, logits=False)
        if dropped and 0 < dropped <= gen.cache.n_past - keep:
            gen.cache.shift(dropped)  # the target dropped these cells: the same ones, after the kept ones
            gen.tokens = gen.tokens[:keep] + gen.tokens[keep + dropped :]
        return gen

    def _score_part(self, gen: Generator) -> None:
        """The draft's decode step scoring the partial head's ids (tokens through another path: all)."""
        if gen.step is None or gen.fast is not None:
            if "part" not in _SAID:
                _SAID.add("part")
                log.warning(
                    "the draft vocabulary is not used: the draft model has no direct decode step here"
                )
            return
        gen.step.head_product = self.part

    def prepare(self, context: Sequence[int], cache: ContextShiftCache, chunk: int | None = None) -> None:
        """Write ``context`` (the target's cached tokens, in ``cache``) into the draft's cache now: a prompt
        the target just read is read by the draft with it (its time the prompt's, as llama.cpp's speculative
        runs read it), not at the first proposal after it; in the pieces of ``chunk`` tokens the target's
        feed wrote, through the same path (a few tokens through the decode step's rows gave other cells
        than the target's forward: an identical draft model lost a fifth of its drafts after them)."""
        if context:
            self._catch_up(self._follow(cache, context), context, chunk=chunk or cache.max_chunk())

    def _catch_up(
        self, gen: Generator, context: Sequence[int], logits: bool = True, chunk: int | None = None
    ) -> torch.Tensor | None:
        """The draft's cache made to hold ``context``: its tokens past what it shares with it rewound, the
        rest written (with ``logits``, the last one always, for its logits, which are returned; with
        ``chunk``, as a feed of pieces of that many tokens writes them)."""
        if self.ids > self.rows:  # the target's padding ids, which the draft's table lacks
            context = [t if t < self.rows else 0 for t in context]
        same = common_prefix(gen.tokens, context)
        if logits:
            same = min(same, len(context) - 1)
        if self.part is not None:
            self.part.hold(context)
        if same < len(gen.tokens):
            gen.rewind(same)
        if same >= len(context):
            return None
        return gen.feed(context[same:], chunk) if chunk else self._write(gen, context[same:])

    @staticmethod
    def _write(gen: Generator, ids: Sequence[int]) -> torch.Tensor:
        """Write ``ids`` into the draft's cache, the last one's logits: a few (the target's new token and
        the drafts it kept) in one pass of the decode step where it takes several rows, as the target checks
        them; more through the model's forward."""
        step = gen.step
        if 1 < len(ids) <= FEW and step is not None and step.supported() and step.native_layers is not None:
            gen.make_room(len(ids))
            logits = step.rows(list(ids), [gen.cache] * len(ids))[-1]
            gen.written(list(ids), logits)
            return logits
        return gen.feed(ids)

    def propose(
        self,
        context: Sequence[int],
        n: int,
        cache: ContextShiftCache,
        sampling: SamplingParams,
        rng: torch.Generator,
    ) -> tuple[list[int], torch.Tensor | None]:
        """Up to ``n`` tokens to follow ``context`` (the target's cached tokens and its last token drawn, in
        ``cache``) under ``sampling``, drawn with ``rng`` (the target's), and the distributions they were
        drawn from (n, vocab), None when greedy."""
        gen = self._follow(cache, context)
        gen.sampling = sampling
        logits = self._as_target(self._catch_up(gen, context))
        n = min(n, gen.cache.free())
        drafts, qs = [], []
        for i in range(n):
            if i:
                logits = self._as_target(gen.write([drafts[-1]]))
            if sampling.temperature == 0:
                drafts.append(gen.next_token(logits))
                continue
            qs.append(gen.probabilities(logits))
            drafts.append(int(torch.multinomial(qs[-1], 1, generator=rng)))
            gen.take(drafts[-1])
        return drafts, torch.stack(qs) if qs else None


def rows_of(model: nn.Module) -> int:
    """The rows of ``model``'s embedding table: the token ids it reads."""
    return model.get_input_embeddings().num_embeddings

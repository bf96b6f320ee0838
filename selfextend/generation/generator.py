"""Our own generation loop over a context-shift cache: prefill, then decode token by token, forever if asked.

transformers' ``generate()`` assumes a cache only grows; ours shrinks at every context shift, so
the loop is ours: make room, forward, pick a token, stream its text.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from selfextend.core.validate import ValidationError, check_int, check_seed, plural
from selfextend.generation.backends import DecodeBackends, decode_backends, weight_owners
from selfextend.generation.decode import tensors_key
from selfextend.generation.grammar import Grammar, GrammarMask, NoTokenLeft
from selfextend.generation.sampling import SamplingParams, any_left, distribution, sample
from selfextend.generation.speculative import Drafter, DraftOdds, speculates, speculative_decode
from selfextend.generation.text import token_ids
from selfextend.hf.facts import cache_kwargs, kv_shape, layer_kinds, require_model, require_weights
from selfextend.kv.cache import ContextShiftCache

log = logging.getLogger(__name__)
PREFILL_CHUNK = 512  # prompt pieces in run(): as llama.cpp's default micro-batch; also the progress step


@dataclass
class GenerationStats:
    """What a run did: tokens, time, shifts and cache fill."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    shifts: int = 0
    n_past: int = 0
    n_ctx: int = 0
    stop_reason: str = ""
    drafted: int = 0  # tokens drafted and checked (speculative decoding)
    kept: int = 0  # of them, those kept

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{plural(self.tokens, 'token')} in {self.seconds:.1f} s "
            f"({self.tokens_per_second:.2f} tokens/s), "
            f"prompt {plural(self.prompt_tokens, 'token')} in {self.prompt_seconds:.1f} s"
            + (f" ({self.reused_tokens} from the prompt cache)" if self.reused_tokens else "")
            + f", {plural(self.shifts, 'context shift')}, cache {self.n_past}/{self.n_ctx}"
            + (f", drafts kept {self.kept}/{self.drafted}" if self.drafted else "")
            + (f", stopped: {self.stop_reason}" if self.stop_reason else "")
        )


_SAID: set[str] = set()


def _check_cells(model: nn.Module, cache: ContextShiftCache) -> None:
    """Refuse a cache made for another model: its layers' cells must be this model's (kv heads, head size)."""
    kv_heads, head_dim = kv_shape(model.config.get_text_config())
    layers = len(layer_kinds(model))
    cells = [(layer.keys.shape[1], layer.keys.shape[3]) for layer in cache.layers]
    if len(cells) != layers or set(cells) != {(kv_heads, head_dim)}:
        raise ValidationError(
            "cache",
            f"holds {len(cells)} layers of {cells[0][0]} KV heads x {cells[0][1]}, made for another model "
            f"(this one: {layers} layers of {kv_heads} x {head_dim})",
        )


def _check_draft(draft: Drafter, model: nn.Module, lookup: int) -> None:
    """Refuse drafts that cannot be the target's: not a drafter, drafts from the context too (one source),
    or a draft model whose table is not the target's (its ``fit``; up to 128 ids apart allowed, tables of one
    tokenizer padded to other sizes). The vocabularies themselves are compared by their tokenizers, which
    only the caller has (:func:`~selfextend.generation.draft.vocabulary_problem`)."""
    if not callable(getattr(draft, "propose", None)) or not callable(getattr(draft, "prepare", None)):
        raise ValidationError("draft", f"must be a Drafter (a DraftModel), got {type(draft).__name__}")
    if lookup:
        raise ValidationError("draft", "and lookup are two sources of drafts: choose one")
    fit = getattr(draft, "fit", None)
    if callable(fit):
        fit(model)


def _said_once(message: str) -> None:
    """Log ``message`` once per process (a setting that cannot apply, said where it is ignored)."""
    if message not in _SAID:
        _SAID.add(message)
        log.warning(message)


@dataclass
class Generator:
    """Prefill and decode through a :class:`ContextShiftCache`; tracks which tokens the cache holds."""

    model: nn.Module
    cache: ContextShiftCache
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V are in the cache, in order
    last_logits: torch.Tensor | None = None  # the logits after the last token written to the cache
    direct_decode: bool = True  # single tokens through a DecodeStep where it serves the model
    compile: bool = False  # single tokens through the compiled step (generation.compiled) where it serves
    backends: DecodeBackends | None = None  # steps shared with other generators (a server's slots): taken
    # as they are, in place of those decode_backends makes (refresh makes this generator's own)
    grammar: Grammar | None = None  # the response format every token drawn must keep (None: any text)
    lookup: int = 0  # drafts checked per pass by prompt lookup (generation.speculative); 0: off
    draft: Drafter | None = None  # drafts from a smaller model instead (generation.draft), its own count
    drafted: int = 0  # tokens drafted and checked so far (speculative decoding)
    kept: int = 0  # of them, those kept
    odds: DraftOdds = field(default_factory=DraftOdds)  # how many drafts the next check is worth

    def __post_init__(self) -> None:
        require_model(self.model, "Generator")
        require_weights(self.model, "Generator")
        if not isinstance(self.cache, ContextShiftCache):
            raise ValidationError("cache", f"must be a ContextShiftCache, got {type(self.cache).__name__}")
        _check_cells(self.model, self.cache)
        if self.cache.n_past != len(self.tokens):  # its stats and shifts would count what it never wrote
            raise ValidationError(
                "cache",
                f"holds {self.cache.n_past} cells and tokens= names {len(self.tokens)}: give an empty cache "
                "(cache.reset()), or the tokens it holds as tokens=",
            )
        if self.cache.layers[0].keys.shape[0] != 1:  # it failed at the first feed, in a matrix product
            raise ValidationError(
                "cache", f"must hold one sequence (batch_size=1), not {self.cache.layers[0].keys.shape[0]}"
            )
        if not isinstance(self.sampling, SamplingParams):
            raise ValidationError("sampling", f"must be a SamplingParams, got {type(self.sampling).__name__}")
        self.sampling.validate()
        self.sampling.check_ids(self.model.get_input_embeddings().num_embeddings)
        self.lookup = check_int(self.lookup, "lookup", 0)
        if self.draft is not None:
            _check_draft(self.draft, self.model, self.lookup)
        self.seed = check_seed(self.seed)
        self.rng = torch.Generator(device="cpu")
        if self.seed is not None:
            self.rng.manual_seed(self.seed)
        else:
            self.rng.seed()
        self.device = next(self.model.parameters()).device
        self._asked = (self.direct_decode, self.compile)  # decode_backends' flags
        self._make_steps(self.backends)

    def _make_steps(self, shared: DecodeBackends | None = None) -> None:
        self.step, self.fast = shared if shared is not None else decode_backends(self.model, *self._asked)
        self._owners = weight_owners(self.model, self.fast)  # none on the CPU: nothing to check
        self._weights = tensors_key(self._owners)

    def checked(self, ids: Sequence[int] | torch.Tensor) -> list[int]:
        """``ids`` as token ids of this model (:func:`token_ids`: TokenIdError for anything else)."""
        return token_ids(ids, self.model.get_input_embeddings().num_embeddings)

    def refresh(self) -> None:
        """Make the decode steps again if a weight of the model was replaced (not edited in place) since they
        were made: on a GPU they read fused copies and a captured graph's addresses of the old tensors.
        Every :meth:`feed` asks first, so an edit between prompts is read (not one between tokens)."""
        if tensors_key(self._owners) != self._weights:
            self._make_steps()

    def make_room(self, n: int) -> None:
        """Shift the cache if ``n`` more tokens do not fit, forgetting the tokens it discards."""
        before = self.cache.n_past
        if self.cache.make_room(n):
            discarded = before - self.cache.n_past
            keep = self.cache.n_keep
            self.tokens = self.tokens[:keep] + self.tokens[keep + discarded :]

    def written(self, ids: list[int], logits: torch.Tensor) -> None:
        """Record that ``ids`` are in the cache now, ``logits`` after the last of them."""
        self.tokens.extend(ids)
        self.last_logits = logits

    @torch.no_grad()
    def write(self, ids: list[int]) -> torch.Tensor:
        """Write ``ids`` into the cache (shifting it first if they do not fit); the last one's logits."""
        self.make_room(len(ids))
        logits = None
        if len(ids) == 1 and self.fast is not None:
            logits = self.fast(ids[0], self.cache)  # None where the compiled step does not serve this token
        if logits is None and len(ids) == 1 and self.step is not None and self.step.supported():
            logits = self.step(ids[0], self.cache)
        if logits is None:
            x = torch.tensor([ids], device=self.device)
            out = self.model(x, **cache_kwargs(self.model, self.cache), use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1]
        self.written(ids, logits)
        return logits

    def rewind(self, n_past: int) -> None:
        """Forget the cached tokens from ``n_past`` on.

        Exact where every layer still holds the cells the tokens before ``n_past`` attend. A sliding-window
        layer keeps only its window, so going back further than that is not: then the cells after the kept
        ones are recomputed from the tokens (the kept cells stay), which is what a fresh forward over the
        kept tokens gives, as after a context shift, and sets :attr:`last_logits`. Otherwise the logits of
        the new last token are not known: :attr:`last_logits` is None (a save then stores none, and the
        next feed or :func:`run` computes them), never those of a token forgotten.
        """
        n_past = check_int(n_past, "n_past", 0)
        tokens = self.tokens[:n_past]
        if self.cache.can_truncate(n_past):
            self.cache.truncate(n_past)
            if len(tokens) < len(self.tokens):
                self.last_logits = None
            self.tokens = tokens
            return
        keep = min(n_past, self.cache.n_keep)
        self.cache.truncate(keep)
        self.tokens = tokens[:keep]
        self.feed(tokens[keep:])

    def feed(
        self,
        ids: Sequence[int],
        chunk: int | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> torch.Tensor:
        """Write ``ids`` into the cache and return the last token's logits.

        Pieces are at most ``chunk`` tokens, by default the largest write one shift always makes room for;
        ``progress`` is called with each piece's length once it is written. A draft model reads them too.
        """
        ids = self.checked(ids)
        if not ids:
            raise ValueError("nothing to feed: empty prompt")
        if chunk is not None:  # a negative one wrote nothing and returned None
            chunk = check_int(chunk, "chunk", 1)
        if self.cache.n_past == 0 and self.tokens:  # the cache was emptied (its reset()): so are its tokens
            self.tokens, self.last_logits = [], None
        self.refresh()
        step = chunk or self.cache.max_chunk()
        logits = None
        for a in range(0, len(ids), step):
            piece = list(ids[a : a + step])
            logits = self.write(piece)
            if progress is not None:
                progress(len(piece))
        if self.draft is not None:
            self.draft.prepare(self.tokens, self.cache, step)
        return logits

    def _allowed(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``logits`` with what :attr:`grammar` bans masked, the tokens the penalties look at);
        :class:`NoTokenLeft` where the logit bias bans every token the grammar allows."""
        recent = torch.tensor(self.sampling.recent(self.tokens), dtype=torch.long, device=logits.device)
        if self.grammar is not None:
            logits = GrammarMask(self.grammar)(recent.view(1, -1), logits.view(1, -1))[0]
            if not any_left(logits, self.sampling, recent):
                raise NoTokenLeft(self.grammar.accepting())
        return logits, recent

    def next_token(self, logits: torch.Tensor) -> int:
        """The next token after ``logits`` (vocab,) under :attr:`sampling`, among those :attr:`grammar`
        allows (masked before every other step of the chain) and then taken by it; :class:`NoTokenLeft`
        where the logit bias bans every token the grammar allows."""
        logits, recent = self._allowed(logits)
        token = sample(logits, self.sampling, recent, self.rng)
        self.take(token)
        return token

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution :meth:`next_token` draws from after ``logits`` (vocab,), on the CPU in float32:
        what speculative sampling's accept/reject rule reads."""
        logits, recent = self._allowed(logits)
        return distribution(logits.cpu(), self.sampling, recent.cpu())

    def take(self, token: int) -> None:
        """``token`` chosen: :attr:`grammar` moves past it."""
        if self.grammar is not None:
            self.grammar.consume(token)

    def decode(
        self,
        logits: torch.Tensor,
        max_new_tokens: int = -1,
        eos_token_ids: Sequence[int] = (),
        stop: Callable[[], bool] | None = None,
    ) -> Iterator[int]:
        """Yield new tokens from the prompt's last ``logits``; ``max_new_tokens == -1`` means no limit.

        The one decode loop of generate, chat and bench. Each yielded token is written to the cache when
        the consumer asks for the next one (a consumer that stops early leaves it out). Stops after an EOS
        token (which is yielded last and not written) unless ``eos_token_ids`` is empty, and before a token
        once ``stop()`` is true. Any other negative count is refused (it would otherwise run forever).
        """
        max_new_tokens = check_int(max_new_tokens, "max_new_tokens", -1)
        rows = getattr(self.model.get_output_embeddings(), "out_features", None)  # None: not known
        vector = isinstance(logits, torch.Tensor) and logits.dim() == 1
        if not vector or (rows is not None and logits.numel() != rows):
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValidationError(  # None failed as an attribute; 5 scores drew ids 0-4; more, an IndexError
                "logits", f"must be the ({rows},) scores a feed or write returns, got {got}"
            )
        most = self.lookup if self.draft is None else self.draft.most
        if most > 0:
            why = speculates(self)
            if why is None:
                yield from speculative_decode(self, logits, max_new_tokens, eos_token_ids, stop, most)
                return
            _said_once(f"speculative decoding off ({why}): each token decoded alone")
        produced = 0
        while (max_new_tokens < 0 or produced < max_new_tokens) and not (stop is not None and stop()):
            token = self.next_token(logits)
            produced += 1
            yield token
            if token in eos_token_ids:
                return
            logits = self.write([token])


def _check_reused(generator: Generator, prompt_ids: list[int], reused: object) -> int:
    """``reused`` as a count of the prompt's first tokens the cache holds as its last written ones (their
    prefill is skipped): within the prompt, no more than the cache holds (unless a shift dropped some of
    them), and ending with the prompt's token before the rest. ValidationError otherwise: a wrong count
    would write the prompt after the wrong cells and reply to another text without a word."""
    reused = check_int(reused, "reused", 0, len(prompt_ids))
    held = generator.tokens
    if reused > len(held) and not generator.cache.shifts:
        raise ValidationError("reused", f"is {reused}, but the cache holds {len(held)} tokens")
    if reused and (not held or held[-1] != prompt_ids[reused - 1]):
        raise ValidationError(
            "reused", f"is {reused}, but the cache's last token is not the prompt's token {reused - 1}"
        )
    return reused


def run(
    generator: Generator,
    prompt_ids: Sequence[int],
    max_new_tokens: int = -1,
    eos_token_ids: Sequence[int] = (),
    reused: int = 0,
    reused_logits: torch.Tensor | None = None,
    progress: Callable[[int], object] | None = None,
) -> Iterator[tuple[int, GenerationStats]]:
    """Prefill ``prompt_ids`` past the ``reused`` tokens cached, then decode; yields (token, stats).

    ``reused_logits``: the last prompt token's logits when the whole prompt is cached with them.
    ``progress``: called with the number of prompt tokens written after each :data:`PREFILL_CHUNK`.

    The last prompt token, whose logits pick the first reply token, is always written alone, through the
    path of every later token (the decode step over the cells as stored), after the rest in prefill
    pieces: a prompt computed fresh and one whose every token but the last is cached then do the same
    arithmetic, so greedy replies do not depend on what the cache held (a prefill's last row and the
    decode step round differently, and near-ties flip).
    """
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", -1)  # refused before the prefill
    prompt_ids = generator.checked(prompt_ids)  # all of them, before the first is written
    if not prompt_ids:
        raise ValidationError("prompt", "is empty: nothing to continue from")
    eos_token_ids = generator.checked(eos_token_ids)
    reused = _check_reused(generator, prompt_ids, reused)
    stats = GenerationStats(prompt_tokens=len(prompt_ids), reused_tokens=reused, n_ctx=generator.cache.n_ctx)
    t0 = time.perf_counter()
    if reused == len(prompt_ids) and reused_logits is not None:
        logits = reused_logits.to(generator.device)
        if generator.draft is not None:  # the draft reads the prompt now, in its time (not at a draft)
            generator.draft.prepare(generator.tokens, generator.cache)
    else:
        if reused == len(prompt_ids):
            # the whole prompt is cached without its logits: re-feed its last token to get them
            generator.rewind(len(generator.tokens) - 1)
            reused -= 1
        if reused < len(prompt_ids) - 1:
            generator.feed(prompt_ids[reused:-1], min(PREFILL_CHUNK, generator.cache.max_chunk()), progress)
        logits = generator.feed(prompt_ids[-1:], progress=progress)
    generator.last_logits = logits
    stats.prompt_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    drafted, kept = generator.drafted, generator.kept
    for token in generator.decode(logits, max_new_tokens, eos_token_ids):
        stats.tokens += 1
        stats.seconds = time.perf_counter() - t0
        # the cells of the tokens so far (a speculative check may hold drafts not yet kept past them)
        stats.shifts, stats.n_past = generator.cache.shifts, len(generator.tokens)
        stats.drafted, stats.kept = generator.drafted - drafted, generator.kept - kept
        yield token, stats

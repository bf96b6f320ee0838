"""Our own generation loop over a context-shift cache: prefill, then decode token by token, forever if asked.

transformers' ``generate()`` assumes a cache only grows; ours shrinks at every context shift, so
the loop is ours: make room, forward, pick a token, stream its text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from selfextend.core.validate import ValidationError, check_int, check_seed, plural
from selfextend.generation import compiled, decode
from selfextend.generation.compiled import fast_decode_for
from selfextend.generation.decode import decode_step_for
from selfextend.generation.grammar import Grammar, GrammarMask, NoTokenLeft
from selfextend.generation.graphed import graphed_decode_for
from selfextend.generation.sampling import SamplingParams, any_left, sample
from selfextend.hf.facts import cache_kwargs
from selfextend.kv.cache import ContextShiftCache
from selfextend.native.decode import native_kernels

CACHE_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}  # llama.cpp's names
NATIVE_CACHE_TYPE = "bf16"  # the default where the native decode step runs (default_cache_dtype)
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
            + (f", stopped: {self.stop_reason}" if self.stop_reason else "")
        )


class TextStream:
    """Incremental detokenizer: emits text only once it is complete (no split multi-byte characters)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            # keep the windows short: the prefix is only context for the tokenizer's spacing rules, and
            # the ids before it are dropped (an endless run would otherwise keep every token it wrote)
            del self.ids[: self.read_offset]
            self.prefix_offset, self.read_offset = 0, len(self.ids)
            return text[len(prefix) :]
        return ""


class StopMatcher:
    """Holds back text that may be the start of a stop string; reports when one is complete."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending = self.pending[:i], ""
                return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


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
    grammar: Grammar | None = None  # the response format every token drawn must keep (None: any text)

    def __post_init__(self) -> None:
        if not isinstance(self.cache, ContextShiftCache):
            raise ValidationError("cache", f"must be a ContextShiftCache, got {type(self.cache).__name__}")
        self.sampling.validate()
        self.seed = check_seed(self.seed)
        self.rng = torch.Generator(device="cpu")
        if self.seed is not None:
            self.rng.manual_seed(self.seed)
        else:
            self.rng.seed()
        self.device = next(self.model.parameters()).device
        single = self.cache.layers[0].keys.shape[0] == 1
        self.step = decode_step_for(self.model) if self.direct_decode and single else None
        self.fast = fast_decode_for(self.model) if single and self.compile else None  # compiled where asked
        if self.fast is None and single and self.direct_decode:  # on a GPU: the step captured as a graph
            self.fast = graphed_decode_for(self.model)

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
        kept tokens gives, as after a context shift, and sets :attr:`last_logits`.
        """
        tokens = self.tokens[:n_past]
        if self.cache.can_truncate(n_past):
            self.cache.truncate(n_past)
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
        ``progress`` is called with each piece's length once it is written.
        """
        if not ids:
            raise ValueError("nothing to feed: empty prompt")
        step = chunk or self.cache.max_chunk()
        logits = None
        for a in range(0, len(ids), step):
            piece = list(ids[a : a + step])
            logits = self.write(piece)
            if progress is not None:
                progress(len(piece))
        return logits

    def next_token(self, logits: torch.Tensor) -> int:
        """The next token after ``logits`` (vocab,) under :attr:`sampling`, among those :attr:`grammar`
        allows (masked before every other step of the chain) and then taken by it; :class:`NoTokenLeft`
        where the logit bias bans every token the grammar allows."""
        recent = torch.tensor(self.sampling.recent(self.tokens), dtype=torch.long, device=logits.device)
        if self.grammar is not None:
            logits = GrammarMask(self.grammar)(recent.view(1, -1), logits.view(1, -1))[0]
            if not any_left(logits, self.sampling, recent):
                raise NoTokenLeft(self.grammar.accepting())
        token = sample(logits, self.sampling, recent, self.rng)
        if self.grammar is not None:
            self.grammar.consume(token)
        return token

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
        produced = 0
        while (max_new_tokens < 0 or produced < max_new_tokens) and not (stop is not None and stop()):
            token = self.next_token(logits)
            produced += 1
            yield token
            if token in eos_token_ids:
                return
            logits = self.write([token])


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
    stats = GenerationStats(prompt_tokens=len(prompt_ids), reused_tokens=reused, n_ctx=generator.cache.n_ctx)
    t0 = time.perf_counter()
    if reused == len(prompt_ids) and reused_logits is not None:
        logits = reused_logits.to(generator.device)
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
    for token in generator.decode(logits, max_new_tokens, eos_token_ids):
        stats.tokens += 1
        stats.seconds = time.perf_counter() - t0
        stats.shifts, stats.n_past = generator.cache.shifts, generator.cache.n_past
        yield token, stats


def default_cache_dtype(model: nn.Module) -> torch.dtype | None:
    """The KV cache's element type when none is asked for and the step is not compiled: bfloat16 where
    :func:`native_cells_default` holds for ``model`` as it runs (and its module layout is the direct step's),
    else None, the model's dtype."""
    param = next(model.parameters())
    native = decode.layout_problem(model) is None and native_cells_default(
        model.config, param.device, param.dtype
    )
    return CACHE_DTYPES[NATIVE_CACHE_TYPE] if native else None


def native_cells_default(config: Any, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a model of ``config`` run in ``dtype`` on ``device`` gets bf16 cells by default: a float32
    model that the direct :class:`~selfextend.generation.decode.DecodeStep` decodes on the CPU with its native
    kernels (which read bf16 cells as stored, plain or Self-Extend: side by side in
    ``python experiments/speed/decode_paths.py direct:f32 direct:bf16``, 0.93-0.95x the time of f32 cells, for
    half the memory; perplexity +0.03%, README). Elsewhere the cells are in the model's dtype (torch's bf16
    CPU attention is slower than its float32 one: bf16 cells would halve the speed there)."""
    direct = torch.device(device).type == "cpu" and dtype == torch.float32
    return direct and decode.config_problem(config) is None and native_kernels() is not None


def decode_settings(
    model: nn.Module, compile: bool | None = None, cache_type: str | None = None
) -> tuple[bool, torch.dtype | None]:
    """(compile, KV cache dtype) from the command-line choices, None meaning the default: compile where it
    pays (:func:`~selfextend.generation.compiled.compile_pays`); the cache in the model's dtype with the
    compiled step (slower over bf16 and f16 cells than over f32), else :func:`default_cache_dtype` (``model``
    as it will run). What the reduced types cost in perplexity and K-shift drift is in the README
    (``experiments/quality/cache_type_ppl.py``, ``experiments/quality/decode_cache_nll.py``)."""
    compile = compiled.compile_pays(model) if compile is None else compile
    if cache_type is None:
        return compile, None if compile else default_cache_dtype(model)
    if cache_type not in CACHE_DTYPES:
        raise ValidationError("cache type", f"must be one of {', '.join(CACHE_DTYPES)}, got {cache_type!r}")
    return compile, CACHE_DTYPES[cache_type]


def eos_token_ids(model: nn.Module, tokenizer) -> tuple[int, ...]:
    """The tokens that end a reply: the generation config's end-of-sequence ids and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return tuple(ids)


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two sequences (token ids or strings)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def build_prompt(
    tokenizer, prompt: str, system: str | None = None, chat: bool = True
) -> tuple[list[int], int]:
    """Token ids of the prompt and how many leading ones are the system part (BOS, system prompt).

    With a chat template, the system part is what two renders with different user texts share
    (the template's system block and the user header); without, it is the BOS and ``system``.
    """
    if chat and getattr(tokenizer, "chat_template", None):

        def render(user: str) -> list[int]:
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": user}
            ]
            return list(
                tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
            )

        ids = render(prompt)
        return ids, common_prefix(render("A"), render("B"))
    text = f"{system}\n\n{prompt}" if system else prompt
    ids = list(tokenizer(text).input_ids)
    if system:
        return ids, common_prefix(ids, tokenizer(f"{system}\n\n").input_ids)
    bos = tokenizer.bos_token_id
    return ids, int(bool(ids) and bos is not None and ids[0] == bos)

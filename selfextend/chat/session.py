"""A conversation that never ends: chat turns through one context-shift cache, replies streamed.

Each user turn is rendered with the model's chat template (:class:`ChatTemplate`), written into a
:class:`ContextShiftCache` that keeps the system part through every shift, and answered token by
token with the :class:`Generator`'s sampling and decode step. When the cache is full, the
:class:`TurnLedger` picks shifts that drop whole old exchanges; the cache moves and re-rotates the
rest. A session (token history, cache contents, kept count, texts, settings) saves to a prompt-cache
file with the chat's state beside it, and loads only into the same model and settings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from selfextend.chat.sessionfile import (
    SESSION_KIND,
    ChatError,
    ChatStats,
    cache_type_name,
    check_positions,
    session_state,
)
from selfextend.chat.template import ChatTemplate
from selfextend.chat.turns import Exchange, ShiftReport, TurnLedger
from selfextend.core.validate import ValidationError, check_int, first_line
from selfextend.generation.generator import PREFILL_CHUNK, Generator
from selfextend.generation.sampling import SamplingParams
from selfextend.generation.speculative import Drafter
from selfextend.generation.text import StopMatcher, TextStream, eos_token_ids
from selfextend.hf.facts import require_model
from selfextend.kv import promptcache
from selfextend.kv.cache import ContextShiftCache

Progress = Callable[[int], AbstractContextManager[Callable[[int], object] | None]]
"""Called with the tokens about to be prefilled; the context's value (if any) gets each piece's length."""


class FileChangedError(ChatError):
    """A session file changed since this session last read or wrote it: another chat is saving to it."""


def _stamp(path: str | Path) -> tuple[int, int]:
    """(modification time in ns, size) of ``path``: what tells that another process wrote it."""
    st = Path(path).stat()
    return st.st_mtime_ns, st.st_size


class _Stopped(Exception):
    """:attr:`ChatSession.stop_requested` seen while a user turn was written."""


class ChatSession:
    """One conversation in a fixed-size cache: :meth:`reply` streams the answer to a user turn.

    ``keep``: cells kept at every shift; ``None`` or -1 keeps the system part (BOS, system prompt or
    the template's default one). ``on_shift`` hears about every context shift. ``model_name``: the model
    as the user named it, recorded in session files so that a resumed chat loads it again.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        n_ctx: int,
        system: str | None = None,
        keep: int | None = None,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
        max_new_tokens: int = 256,
        ignore_eos: bool = False,
        stops: tuple[str, ...] = (),
        on_shift: Callable[[ShiftReport], None] | None = None,
        progress: Progress | None = None,
        compile: bool = False,
        cache_dtype: torch.dtype | None = None,
        model_name: str | None = None,
        lookup: int = 0,
        draft: Drafter | None = None,
    ) -> None:
        require_model(model, "ChatSession")  # each below was an AttributeError or TypeError from inside
        if not callable(getattr(tokenizer, "apply_chat_template", None)):
            raise ValidationError(
                "tokenizer", f"must be a transformers tokenizer, got {type(tokenizer).__name__}"
            )
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise ValidationError("sampling", f"must be a SamplingParams, got {type(sampling).__name__}")
        self.model, self.tokenizer, self.n_ctx = model, tokenizer, check_int(n_ctx, "n_ctx", 2)
        self.sampling = sampling or SamplingParams()
        self.sampling.validate()
        # checked before a turn is written: a bad count left a half exchange in the cache
        self.seed, self.max_new_tokens = seed, check_int(max_new_tokens, "max_new_tokens", -1)
        self.eos = () if ignore_eos else eos_token_ids(model, tokenizer)
        # a string is one stop (tuple() read it as one stop per letter)
        self.stops = (stops,) if isinstance(stops, str) else tuple(stops)
        self.on_shift, self.progress = on_shift, progress
        self.keep = keep
        self.compile, self.cache_dtype = (
            compile,
            cache_dtype,
        )  # decode path and KV element type (model's: None)
        self.model_name = model_name
        self.lookup = lookup  # drafted tokens checked per pass (generation.speculative)
        self.draft = draft  # or drafts from a draft model (generation.draft)
        self.stop_requested = False
        self._files: dict[Path, tuple[int, int]] = {}  # the files this session read or wrote: as it left them
        self.start(system)

    # --- state ---------------------------------------------------------------------------------

    def start(self, system: str | None) -> None:
        """Begin an empty conversation under ``system``: a fresh cache holding only the system part, and
        fresh :attr:`stats` (what ``/stats`` reports is this conversation's). A system prompt refused (no room
        left, text it cannot take) changes nothing."""
        if system is not None and not isinstance(system, str):
            raise ValidationError("system", f"must be text or None, got {type(system).__name__}")
        template = ChatTemplate(self.tokenizer, system)
        system_ids = template.ids(template.system_text)
        n_keep = len(system_ids) if self.keep in (None, -1) else self.keep
        if n_keep >= self.n_ctx - 1:
            raise ChatError(
                f"keeping {n_keep} tokens (the system prompt) leaves no room in a cache of {self.n_ctx}; "
                "raise --ctx or shorten the system prompt"
            )
        cache = ContextShiftCache(self.model, n_ctx=self.n_ctx, n_keep=n_keep, dtype=self.cache_dtype)
        self.stats, self.template = ChatStats(), template
        self._build(cache)
        if system_ids:
            self._prefill(system_ids)

    def _build(self, cache: ContextShiftCache, tokens: list[int] | None = None) -> None:
        """A conversation over ``cache``, which holds ``tokens`` (none: it is empty)."""
        self.cache = cache
        self.exchanges: list[Exchange] = []
        self.ledger = TurnLedger(self.exchanges, self.on_shift)
        self.cache.discard_policy = self.ledger.discard
        self.gen = Generator(
            self.model,
            self.cache,
            self.sampling,
            self.seed,
            compile=self.compile,
            lookup=self.lookup,
            draft=self.draft,
            tokens=tokens or [],
        )
        self.closed = True  # the last reply's closing markers are in the cache (or there is no reply)
        self._before_reply: tuple[Exchange | None, torch.Tensor | None] = (None, None)  # for /retry

    @property
    def system(self) -> str | None:
        return self.template.system

    @property
    def n_keep(self) -> int:
        return self.cache.n_keep

    def _prefill(self, ids: list[int], stoppable: bool = False) -> torch.Tensor:
        """Write a prompt piece in :data:`PREFILL_CHUNK` pieces, with the progress hook around it; with
        ``stoppable``, :attr:`stop_requested` ends it after the piece being written (:class:`_Stopped`)."""
        t0 = time.perf_counter()

        def written(n: int, update: Callable[[int], object] | None) -> None:
            if update is not None:
                update(n)
            self.stats.prompt_tokens += n
            if stoppable and self.stop_requested:
                raise _Stopped

        try:
            with self.progress(len(ids)) if self.progress else nullcontext() as update:
                return self.gen.feed(
                    ids, min(PREFILL_CHUNK, self.cache.max_chunk()), lambda n: written(n, update)
                )
        finally:
            self.stats.prompt_seconds += time.perf_counter() - t0

    def _truncate(self, n_past: int) -> None:
        """Forget cells from ``n_past`` on, and every recorded position there (a sliding-window layer that
        has dropped cells still needed has the cells after the kept ones recomputed: ``Generator.rewind``)."""
        self.gen.rewind(n_past)
        for e in self.exchanges:
            e.start = e.start if e.start is not None and e.start < n_past else None
            e.reply_start = e.reply_start if e.reply_start is not None and e.reply_start < n_past else None

    # --- turns ---------------------------------------------------------------------------------

    def reply(self, user: str) -> Iterator[str]:
        """Write the user turn and stream the reply's text. Stops at end of sequence, at a stop string,
        after ``max_new_tokens``, or at the next token once :attr:`stop_requested` is set."""
        if not isinstance(user, str):
            raise ValidationError("user", f"must be text, got {type(user).__name__}")
        self.stop_requested = False
        if not self.exchanges:
            closing, turn = "", self.template.first_turn(user)
        else:
            closing, turn = self.template.next_turn(self.exchanges[-1], user)
        closing_ids = self.template.ids(closing) if closing and not self.closed else []
        turn_ids = self.template.ids(turn)  # (text it cannot take is refused before anything is written)
        if closing_ids:
            self._prefill(closing_ids)
        exchange = Exchange(user, start=self.cache.n_past)
        self.exchanges.append(exchange)
        self.closed = False
        try:
            logits = self._prefill(turn_ids, stoppable=True)
        except _Stopped:  # Ctrl-C while a long turn was read: the turn is taken back, no reply
            self.undo()
            return
        exchange.reply_start = self.cache.n_past
        self._before_reply = (exchange, logits)
        yield from self._generate(exchange, logits)

    def retry(self) -> Iterator[str]:
        """Generate the last reply again (the cache rewound to its first cell; ``reply_start`` is None once
        a shift has dropped that cell or the one before it, the turn's last token, which is written again)."""
        if not self.exchanges:
            raise ChatError("nothing to retry: no reply yet")
        exchange = self.exchanges[-1]
        start = exchange.reply_start
        if start is None or start == 0:
            raise ChatError("cannot retry: the start of the last reply has been shifted out of the cache")
        self.stop_requested = False
        exchange_then, logits = self._before_reply
        if exchange_then is exchange:  # the logits the reply was drawn from: greedy gives it again exactly
            self._truncate(start)
        else:  # a session loaded from a file: its turn's last token written again (a near tie may flip)
            last = self.gen.tokens[start - 1]
            self._truncate(start - 1)
            logits = self.gen.feed([last])
        exchange.reply_start, exchange.reply, self.closed = start, "", False
        yield from self._generate(exchange, logits)

    def undo(self) -> Exchange:
        """Drop the last exchange; the cache rewinds to where it started (to the kept part if its start
        was shifted out). Returns the dropped exchange."""
        if not self.exchanges:
            raise ChatError("nothing to undo")
        exchange = self.exchanges.pop()
        self._truncate(exchange.start if exchange.start is not None else self.n_keep)
        self.closed = True
        return exchange

    def _generate(self, exchange: Exchange, logits: torch.Tensor) -> Iterator[str]:
        stream, stops = (
            TextStream(self.tokenizer),
            StopMatcher(self.stops + self.template.stops, self.tokenizer),
        )
        ids: list[int] = []
        shown = ""
        t0 = time.perf_counter()
        tokens = self.gen.decode(logits, self.max_new_tokens, self.eos, lambda: self.stop_requested)
        stopped = False
        for token in tokens:
            if token in self.eos:  # the text held back for a possible stop string is the reply's end
                tail = stops.flush()
                if tail:
                    yield tail
                break
            text, stopped = stops.push(stream.push(token), token)
            shown += text
            yield text
            if stopped:
                break
            ids.append(token)
        else:
            tail = stops.flush()
            if tail:
                yield tail
        tokens.close()  # drafts checked past the last token taken leave the cache first
        if stopped:
            ids = self._cut_to(ids, shown)
        seconds = time.perf_counter() - t0
        exchange.reply = self.tokenizer.decode(ids, skip_special_tokens=False)
        self.stats.replies += 1
        self.stats.tokens += len(ids)
        self.stats.seconds += seconds
        self.stats.last_tokens, self.stats.last_seconds = len(ids), seconds

    def _cut_to(self, ids: list[int], shown: str) -> list[int]:
        """After a stop string: the reply tokens whose text is what was shown; the cells of the rest
        (the stop string's start) leave the cache."""
        keep = len(ids)
        while keep and not shown.startswith(self.tokenizer.decode(ids[:keep], skip_special_tokens=True)):
            keep -= 1
        cut = len(ids) - keep
        if cut:
            self._truncate(max(self.cache.n_past - cut, self.n_keep))
        return ids[:keep]

    # --- files ---------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Everything besides the cells that a later process needs to continue exactly."""
        return {
            "kind": SESSION_KIND,
            "model": self.model_name,
            "cache_type": cache_type_name(self.cache.layers[0].keys.dtype),
            "n_ctx": self.n_ctx,
            "n_keep": self.n_keep,
            "keep": self.keep,
            "system": self.system,
            "closed": self.closed,
            "exchanges": [asdict(e) for e in self.exchanges],
            "shifts": self.cache.shifts,
            "discarded": self.cache.discarded,
            "dropped_exchanges": self.ledger.dropped_exchanges,
            "stats": asdict(self.stats),
            "sampling": asdict(self.sampling),
            "rng": self.gen.rng.get_state().tolist(),
        }

    def save(self, path: str | Path) -> None:
        """Write the whole session: cells, token history, last logits, texts, kept count, settings.

        A file that cannot be written, one there that is not a saved cache (a text file named by mistake), or
        one that changed since this session last read or wrote it (another chat saving to it) raises
        :class:`ChatError` (one line) and leaves the session and the file as they are.
        """
        folder = Path(path).absolute().parent
        if not folder.is_dir():
            raise ChatError(f"cannot save the session to {path}: no folder {folder}")
        if not promptcache.may_replace(path):
            raise ChatError(f"{path} is there and is not a saved session: not overwritten")
        seen = self._files.get(Path(path).absolute())
        if seen is not None and _stamp(path) != seen:
            raise FileChangedError(
                f"{path} changed since this chat last read or wrote it (another chat saving to it?): "
                "not overwritten"
            )
        logits = self.gen.last_logits if self.gen.last_logits is not None else torch.zeros(0)
        try:
            promptcache.save(path, self.model, self.cache, self.gen.tokens, logits, extra=self.state())
        except (OSError, RuntimeError) as e:  # torch.save reports some file errors as RuntimeError
            why = e.strerror if isinstance(e, OSError) and e.strerror else first_line(e)
            raise ChatError(f"cannot save the session to {path}: {why}") from None
        self._files[Path(path).absolute()] = _stamp(path)

    def load(self, path: str | Path) -> None:
        """Replace this session with the one saved in ``path``; the file must come from the same model,
        dtype, weight format, Self-Extend settings, ``--ctx`` and cache type, else :class:`ChatError` (and
        nothing changes)."""
        try:
            payload = promptcache.read(path, self.model, self.cache)
        except promptcache.PromptCacheError as e:
            raise ChatError(str(e)) from None
        state = session_state(payload, path)
        if state["n_ctx"] != self.n_ctx:
            raise ChatError(f"{path} was saved with --ctx {state['n_ctx']}, this session has {self.n_ctx}")
        cache_type = cache_type_name(self.cache.layers[0].keys.dtype)
        if state["cache_type"] != cache_type:
            raise ChatError(
                f"{path} was saved with --cache-type {state['cache_type']}, this session has {cache_type}"
            )
        tokens = payload["tokens"].tolist()
        check_positions(len(tokens), state, path)
        template = ChatTemplate(self.tokenizer, state["system"])
        kept = len(template.ids(template.system_text)) if state["keep"] in (None, -1) else state["keep"]
        if state["n_keep"] != kept:
            raise ChatError(
                f"{path}: damaged session state (n_keep {state['n_keep']}, the settings keep {kept})"
            )
        try:
            exchanges = [Exchange(**e) for e in state["exchanges"]]
            stats = ChatStats(**state["stats"])
            rng = torch.tensor(state["rng"], dtype=torch.uint8)
            torch.Generator().set_state(rng)
        except (TypeError, ValueError, RuntimeError):
            raise ChatError(f"{path}: damaged session state") from None
        cache = ContextShiftCache(
            self.model, n_ctx=self.n_ctx, n_keep=state["n_keep"], dtype=self.cache_dtype
        )
        try:
            cache.load_prefix(payload["keys"], payload["values"], len(tokens), promptcache.positions(payload))
        except ValueError as e:
            raise ChatError(f"{path}: {e}") from None
        self.keep, self.template = state["keep"], template
        self._build(cache, tokens)
        self.gen.last_logits = payload["logits"] if payload["logits"].numel() else None
        self.gen.rng.set_state(rng)
        self.exchanges.extend(exchanges)
        self.closed = state["closed"]
        self.cache.shifts, self.cache.discarded = state["shifts"], state["discarded"]
        self.ledger.dropped_exchanges = state["dropped_exchanges"]
        self.stats = stats
        self._files[Path(path).absolute()] = _stamp(path)

"""The flags of the commands that generate (generate, chat, bench, serve): system prompt, cache, lengths,
sampling, output, decoding."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import click

from selfextend.cli.options import (
    COUNT,
    SEED,
    in_writable_folder,
    integer,
    model_options,
    number,
    self_extend_options,
    weights_option,
)
from selfextend.core.validate import MAX_TEMPERATURE, PENALTY_RANGE

CACHE_TYPES = ("f32", "bf16", "f16")  # generation.settings.CACHE_DTYPES's names


def system_options(f: Callable) -> Callable:
    """--system, --system-file: the system prompt, kept through every context shift."""
    f = click.option(
        "--system-file",
        type=click.Path(dir_okay=False),
        help="Read the system prompt from this UTF-8 file.",
    )(f)
    f = click.option("--system", help="System prompt; kept through every context shift.")(f)
    return f


def system_prompt(system: str | None, system_file: str | None) -> str | None:
    """The system prompt from --system or --system-file (not both)."""
    if system is not None and system_file:
        raise click.UsageError("give --system or --system-file, not both")
    if system_file:
        from selfextend.evaluation.corpus import read_text_file

        return read_text_file(system_file).strip()
    return system


def cache_options(f: Callable) -> Callable:
    """--ctx, --keep: the context-shift cache's size and the tokens every shift keeps."""
    f = click.option(
        "--keep",
        type=integer(-1),
        default=None,
        help="Tokens kept at every shift. Default: BOS + the system prompt, or the first 4 tokens where "
        "there is neither (attention sinks); -1: the whole prompt (in chat: the system prompt). In generate "
        "at most the prompt's tokens.",
    )(f)
    f = click.option(
        "-c",
        "--ctx",
        type=integer(2),
        default=2048,
        show_default=True,
        help="KV cache capacity in tokens; when full, the older half after --keep is dropped.",
    )(f)
    return f


def check_cache(ctx: int, keep: int | None) -> None:
    """One line for a cache that cannot exist: no room, or more kept than there is."""
    if keep is not None and keep >= ctx:
        raise click.BadParameter(f"{keep} must be smaller than --ctx ({ctx})", param_hint="--keep")


def check_keep(n_keep: int, ctx: int, kept: str | None = None) -> None:
    """The kept tokens, once known, must leave room to generate; ``kept``: what they are when the user
    did not choose them with --keep (the system prompt), named instead of an option never given."""
    if n_keep >= ctx - 1 and kept:
        raise click.UsageError(f"{kept} is {n_keep} tokens, which leaves no room in --ctx {ctx}: raise --ctx")
    if n_keep >= ctx - 1:
        raise click.BadParameter(
            f"keeping {n_keep} tokens leaves no room in a cache of {ctx}; raise --ctx or lower --keep",
            param_hint="--keep",
        )


def kept_part(system: str | None, chat: bool, tokenizer) -> str:
    """What the kept system part is, named for an error: the user's system prompt, or the block a chat
    template writes on its own (its default system prompt, the user's header), which no option gave."""
    if system:
        return "the system prompt"
    if chat and getattr(tokenizer, "chat_template", None):
        return "the chat template's own start (its default system prompt and the user's header)"
    return "the BOS token"


def _stop_texts(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    """An empty stop text was taken and never matched."""
    if any(not text for text in value):
        raise click.BadParameter("a stop text is empty (it would never match)")
    return value


def length_options(f: Callable) -> Callable:
    """-n, --ignore-eos, --stop: when a reply ends."""
    f = click.option(
        "--stop",
        multiple=True,
        callback=_stop_texts,
        help="Stop when this text appears (repeatable); a special token's text (<|im_end|>): at that token.",
    )(f)
    f = click.option("--ignore-eos", is_flag=True, help="Do not stop at end-of-sequence tokens.")(f)
    f = click.option(
        "-n",
        "--max-new-tokens",
        type=integer(-1),
        default=256,
        show_default=True,
        help="Tokens to generate (in chat: per reply); -1 goes on until end of sequence or Ctrl-C "
        "(with --ignore-eos, forever).",
    )(f)
    return f


def sampling_options(f: Callable) -> Callable:
    """The sampling flags; the command receives them as one ``sampling: SamplingParams`` and ``seed``."""

    @functools.wraps(f)
    def wrapper(
        *args,
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty,
        repeat_last_n,
        frequency_penalty,
        presence_penalty,
        **kwargs,
    ):
        from selfextend.generation.sampling import SamplingParams

        sampling = SamplingParams(
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            repeat_last_n,
            frequency_penalty,
            presence_penalty,
        )
        sampling.validate()
        return f(*args, sampling=sampling, **kwargs)

    for decorator in reversed(
        [
            click.option(
                "--temperature",
                "--temp",  # llama.cpp's name
                "temperature",
                type=number(0.0, MAX_TEMPERATURE),
                default=0.8,
                show_default=True,
                help="0 = greedy (as is below 1e-4); applied after the filters, as llama.cpp does.",
            ),
            click.option(
                "--top-k",
                type=COUNT,
                default=40,
                show_default=True,
                help="Keep the k most likely tokens (0 = off).",
            ),
            click.option(
                "--top-p",
                type=number(0.0, 1.0),
                default=0.95,
                show_default=True,
                help="Nucleus: smallest set with this mass (0: the most likely token alone, greedy).",
            ),
            click.option(
                "--min-p",
                type=number(0.0, 1.0, hi_open=True),
                default=0.05,
                show_default=True,
                help="Drop tokens below this fraction of the top token's probability.",
            ),
            click.option(
                "--repeat-penalty",
                type=number(*PENALTY_RANGE),
                default=1.0,
                show_default=True,
                help="Penalty for tokens among the last --repeat-last-n (1 = off).",
            ),
            click.option(
                "--repeat-last-n",
                type=integer(-1),
                default=64,
                show_default=True,
                help="Window of the penalties, tokens (0 = no penalty, -1 = the whole context).",
            ),
            click.option(
                "--frequency-penalty",
                type=number(-2.0, 2.0),
                default=0.0,
                show_default=True,
                help="Subtracted from a token's logit once per time it occurs in the window (0 = off).",
            ),
            click.option(
                "--presence-penalty",
                type=number(-2.0, 2.0),
                default=0.0,
                show_default=True,
                help="Subtracted from the logit of every token that occurs in the window (0 = off).",
            ),
            click.option("--seed", type=SEED, default=None, help="Sampling seed (default: random)."),
        ]
    ):
        wrapper = decorator(wrapper)
    return wrapper


def output_options(f: Callable) -> Callable:
    """-o/--output, --stats-every: where the text goes besides the terminal, and progress lines."""
    f = click.option(
        "--stats-every",
        type=COUNT,
        default=0,
        help="Every N tokens, print a JSON line on stderr: tokens, tokens/s over the last N, RSS MiB.",
    )(f)
    f = click.option(
        "-o",
        "--output",
        type=click.Path(dir_okay=False),
        callback=in_writable_folder,
        help="Also append the generated text to this file, flushed as tokens arrive.",
    )(f)
    return f


def cache_type_option(f: Callable) -> Callable:
    """--cache-type: the KV cache's element type."""
    return click.option(
        "--cache-type",
        type=click.Choice(list(CACHE_TYPES)),
        default=None,
        help="KV cache element type (llama.cpp's names): f32, bf16 or f16 (half the bytes per cell; "
        "context shifts re-rotate keys in float32 and round once). Default: bf16 where the native decode "
        "step runs (a float32 Llama, Mistral, Qwen2/3 or Gemma 3 on the CPU, a C compiler present, not "
        "--compile), "
        "else the model's dtype.",
    )(f)


def decode_options(f: Callable) -> Callable:
    """--compile/--no-compile, --cache-type: how single tokens are decoded and the KV cache's element type."""
    f = cache_type_option(f)
    f = click.option(
        "--compile/--no-compile",
        "compile_step",
        default=None,
        help="Decode through the torch.compile'd step (one decoder layer compiled, its graph kept on disk "
        "for later runs). Default: off (SELFEXTEND_COMPILE=1 turns it on for a CPU); falls back to eager "
        "with a warning if compiling fails. On a GPU the step is captured as a CUDA graph instead.",
    )(f)
    return f


@dataclasses.dataclass
class Speculation:
    """The speculative-decoding flags: ``lookup`` drafts per pass by prompt lookup, or a draft model's file
    or name with ``draft_max`` drafts per pass (neither: off)."""

    lookup: int = 0
    draft_model: str | None = None
    draft_max: int = 16
    draft_vocab: int | None = None

    def drafter(
        self,
        tokenizer,
        dtype: str,
        device: str,
        group_size: int | None,
        window: int | None,
        weights: str,
        cache_dtype,
    ):
        """The :class:`~selfextend.generation.draft.DraftModel` for the model of ``tokenizer`` (loaded as that
        model is, with its Self-Extend settings), or None without ``--draft-model``; a usage error where the
        draft's vocabulary is not the model's."""
        if self.draft_model is None:
            return None
        from selfextend.cli.options import load_with_self_extend
        from selfextend.generation.draft import DraftModel, vocabulary_problem

        try:
            draft, draft_tokenizer = load_with_self_extend(
                self.draft_model, dtype, device, group_size, window, weights
            )
        except ValueError as e:  # the model's refusals (ModelError): said of this option, not of -m
            raise click.UsageError(f"--draft-model {self.draft_model}: {e}") from None
        problem = vocabulary_problem(tokenizer, draft_tokenizer)
        if problem is not None:
            raise click.UsageError(f"--draft-model {self.draft_model}: {problem}")
        try:
            return DraftModel(draft, self.draft_max, cache_dtype=cache_dtype, vocab=self.draft_vocab)
        except ValueError as e:
            raise click.UsageError(f"--draft-vocab {self.draft_vocab}: {e}") from None


def speculative_options(f: Callable) -> Callable:
    """--lookup, --draft-model, --draft-max, --draft-vocab: received as one ``speculation: Speculation``."""

    @functools.wraps(f)
    def wrapper(*args, lookup, draft_model, draft_max, draft_vocab, **kwargs):
        if lookup and draft_model:
            raise click.UsageError("choose one source of drafts: --lookup N or --draft-model FILE")
        if draft_vocab is not None and not draft_model:
            raise click.UsageError("--draft-vocab needs --draft-model")
        ctx = click.get_current_context()
        if ctx.get_parameter_source("draft_max") != click.core.ParameterSource.DEFAULT and not draft_model:
            raise click.UsageError("--draft-max needs --draft-model")
        return f(*args, speculation=Speculation(lookup, draft_model, draft_max, draft_vocab), **kwargs)

    for decorator in reversed(
        [
            click.option(
                "--lookup",
                type=COUNT,
                default=0,
                show_default=True,
                help="Speculative decoding by prompt lookup: up to this many tokens drafted from the context "
                "(what followed the last few tokens before) and checked in one pass; greedy output identical "
                "to without, sampled output from the same distribution (GGUF blocks on the CPU; elsewhere "
                "each token alone). Pays where text repeats: copies, edits, summaries quoting their source.",
            ),
            click.option(
                "--draft-model",
                metavar="MODEL",
                help="Speculative decoding with drafts from this smaller model (a .gguf file or a name, "
                "loaded as the model is, with its Self-Extend settings); its vocabulary must be the model's. "
                "Greedy output identical to without, sampled output from the same distribution.",
            ),
            click.option(
                "--draft-max",
                type=click.IntRange(1),
                default=16,
                show_default=True,
                help="Tokens the draft model drafts per pass at most (fewer after passes that keep none).",
            ),
            click.option(
                "--draft-vocab",
                type=click.IntRange(1),
                default=None,
                metavar="N",
                help="The draft model's output layer scores only the first N token ids and the ids in the "
                "context (default: all): faster drafts where the vocabulary is large (Gemma 3's 262,144: "
                "try 65536). Output unchanged: the model checks every draft.",
            ),
        ]
    ):
        wrapper = decorator(wrapper)
    return wrapper


def generation_options(default_weights: str) -> Callable[[Callable], Callable]:
    """Everything ``generate`` and ``chat`` share: model, weights, Self-Extend, cache, system prompt,
    reply length, sampling and output."""

    def decorate(f: Callable) -> Callable:
        for decorator in reversed(
            [
                model_options,
                weights_option(default_weights),
                self_extend_options,
                system_options,
                cache_options,
                decode_options,
                speculative_options,
                length_options,
                sampling_options,
                output_options,
            ]
        ):
            f = decorator(f)
        return f

    return decorate

"""Options shared by several commands, and the model loading they lead to."""

from __future__ import annotations

import functools
from collections.abc import Callable

import click


class Checked(click.ParamType):
    """A click type that parses with a :mod:`selfextend.core.validate` function (imported when a value comes,
    so ``--help`` stays light), so the CLI and the library accept and refuse the same numbers; click then
    names the option in its one-line error."""

    def __init__(self, name: str, parser: str, **bounds: object) -> None:
        self.name, self.parser, self.bounds = name, parser, bounds

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> object:
        from selfextend.core import validate

        try:
            return getattr(validate, self.parser)(value, param.name if param else self.name, **self.bounds)
        except validate.ValidationError as e:
            self.fail(e.requirement, param, ctx)


def integer(lo: int | None = None, **bounds: int) -> Checked:
    """An integer option >= lo (``hi=`` an upper bound; nothing too large to use, no floats or booleans)."""
    return Checked("integer", "parse_int", lo=lo, **bounds)


def number(lo: float | None = None, hi: float | None = None, **open_ends: bool) -> Checked:
    """A finite number option (``nan``/``inf`` refused) in the range; ``lo_open``/``hi_open`` exclude ends."""
    return Checked("number", "parse_float", lo=lo, hi=hi, **open_ends)


SEED = Checked("seed", "parse_seed")
POSITIVE = integer(1)
COUNT = integer(0)
CACHE_TYPES = ("f32", "bf16", "f16")  # generation.generator.CACHE_DTYPES's names


def _set_threads(ctx: click.Context, param: click.Parameter, value: int | None) -> None:
    if value is not None:
        import torch

        torch.set_num_threads(value)


def threads_option(f: Callable) -> Callable:
    """--threads: torch's intra-op CPU threads, set while the command line is parsed."""
    return click.option(
        "-t",
        "--threads",
        type=POSITIVE,
        default=None,
        expose_value=False,
        callback=_set_threads,
        help="CPU threads for the model's arithmetic (default: what torch picks, usually one per core).",
    )(f)


def model_options(f: Callable) -> Callable:
    """--model, --dtype, --device, --threads."""
    f = threads_option(f)
    f = click.option(
        "--device", default="cpu", show_default=True, help="torch device: cpu, cuda, cuda:1, mps."
    )(f)
    f = click.option(
        "--dtype",
        default="float32",
        show_default=True,
        help="Weights and activations: float32, bfloat16 or float16.",
    )(f)
    f = click.option(
        "-m",
        "--model",
        default="smollm2-135m",
        show_default=True,
        help="smollm2-135m (embedded), gemma3-270m (the gemma extra), a .gguf file, a model directory "
        "or a hub id.",
    )(f)
    return f


def weights_option(default: str) -> Callable[[Callable], Callable]:
    """--weights: float (the model's dtype) or int8 (weight-only, a quarter of float32's bytes)."""
    return click.option(
        "--weights",
        type=click.Choice(["float", "int8"]),
        default=default,
        show_default=True,
        help="Linear-layer weights: float (as --dtype) or int8 (per-row weight-only, bfloat16 products; "
        "decoding reads 4x fewer bytes than float32).",
    )


def run_name(model: str, weights: str) -> str:
    """The model's name in result records: int8 weights are another model for resuming and plotting."""
    return model if weights == "float" else f"{model}+{weights}"


def self_extend_options(f: Callable) -> Callable:
    """--group-size/--window: both or neither turn Self-Extend on."""
    f = click.option(
        "-w",
        "--window",
        type=POSITIVE,
        default=None,
        help="Self-Extend neighbor window W in tokens (exact positions inside it).",
    )(f)
    f = click.option(
        "-g",
        "--group-size",
        type=POSITIVE,
        default=None,
        help="Self-Extend group size G: positions beyond the window are floor-divided by G.",
    )(f)
    return f


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def device_map_option(f: Callable) -> Callable:
    """--device-map: accelerate's big-model placement, layers spread over the GPUs (then CPU, then disk).

    The value goes to ``ctx.meta["device_map"]``, where :func:`load_with_self_extend` finds it, so the
    commands' signatures stay as they are.
    """

    def remember(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
        ctx.meta["device_map"] = value

    return click.option(
        "--device-map",
        type=click.Choice(DEVICE_MAPS),
        default=None,
        expose_value=False,
        callback=remember,
        help="Place the layers of a model too big for one device over several (accelerate's device_map; "
        "auto: GPUs first, then CPU memory, then disk). Replaces --device. Multi-GPU placement is untested.",
    )(f)


def load_with_self_extend(
    model: str,
    dtype: str,
    device: str,
    group_size: int | None,
    window: int | None,
    weights: str = "float",
):
    """Load a model (and tokenizer) with its weights in ``weights`` format, and Self-Extend when G and W
    are given."""
    import transformers

    from selfextend.hf.patch import apply_self_extend
    from selfextend.models import load_model

    if (group_size is None) != (window is None):
        raise click.UsageError("Self-Extend needs both --group-size and --window")
    ctx = click.get_current_context(silent=True)
    device_map = ctx.meta.get("device_map") if ctx else None
    if device_map and weights != "float":
        raise click.UsageError(
            "--device-map needs --weights float (int8 layers are not placed by accelerate)"
        )
    transformers.utils.logging.disable_progress_bar()
    lm, tokenizer = load_model(model, dtype=dtype, device=device, weights=weights, device_map=device_map)
    if group_size is not None:
        apply_self_extend(lm, group_size, window)
    return lm, tokenizer


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
        help="Tokens kept at every shift. Default: BOS + the system prompt; -1: the whole prompt "
        "(in chat: the system prompt).",
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
        raise click.BadParameter(f"--keep ({keep}) must be smaller than --ctx ({ctx})", param_hint="--keep")


def check_keep(n_keep: int, ctx: int) -> None:
    """The kept tokens, once known, must leave room to generate."""
    if n_keep >= ctx - 1:
        raise click.BadParameter(
            f"keeping {n_keep} tokens leaves no room in a cache of {ctx}; raise --ctx or lower --keep",
            param_hint="--keep",
        )


def length_options(f: Callable) -> Callable:
    """-n, --ignore-eos, --stop: when a reply ends."""
    f = click.option("--stop", multiple=True, help="Stop when this text appears (repeatable).")(f)
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
    def wrapper(*args, temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, **kwargs):
        from selfextend.generation.sampling import SamplingParams

        sampling = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n)
        sampling.validate()
        return f(*args, sampling=sampling, **kwargs)

    for decorator in reversed(
        [
            click.option(
                "--temperature", type=number(0.0), default=0.8, show_default=True, help="0 = greedy."
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
                type=number(0.0, 1.0, lo_open=True),
                default=0.95,
                show_default=True,
                help="Nucleus: smallest set with this mass.",
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
                type=number(0.0, lo_open=True),
                default=1.0,
                show_default=True,
                help="Penalty for tokens among the last --repeat-last-n (1 = off).",
            ),
            click.option(
                "--repeat-last-n",
                type=integer(-1),
                default=64,
                show_default=True,
                help="Window of the repeat penalty, tokens (0 = no penalty, -1 = the whole context).",
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
        help="Also append the generated text to this file, flushed as tokens arrive.",
    )(f)
    return f


def decode_options(f: Callable) -> Callable:
    """--compile/--no-compile, --cache-type: how single tokens are decoded and the KV cache's element type."""
    f = click.option(
        "--cache-type",
        type=click.Choice(list(CACHE_TYPES)),
        default=None,
        help="KV cache element type (llama.cpp's names): f32, bf16 or f16 (half the bytes per cell; "
        "context shifts re-rotate keys in float32 and round once). Default: f16 with --compile, else "
        "the model's dtype.",
    )(f)
    f = click.option(
        "--compile/--no-compile",
        "compile_step",
        default=None,
        help="Decode through one torch.compile'd step (compiled once, kept on disk for later runs). "
        "Default: on for CPU, off elsewhere; falls back to eager with a warning if compiling fails.",
    )(f)
    return f


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
                length_options,
                sampling_options,
                output_options,
            ]
        ):
            f = decorator(f)
        return f

    return decorate

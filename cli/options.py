"""Options shared by several commands, and the model loading they lead to."""

from __future__ import annotations

from collections.abc import Callable

import click

from selfextend.validate import MAX_INT, MAX_SEED, ValidationError, parse_float, parse_int


class Checked(click.ParamType):
    """A click type that parses with :mod:`selfextend.validate`, so the CLI and the library accept and
    refuse the same numbers; click then names the option in its one-line error."""

    def __init__(self, name: str, parse: Callable[[object, str], object]) -> None:
        self.name, self.parse = name, parse

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> object:
        try:
            return self.parse(value, param.name if param else self.name)
        except ValidationError as e:
            self.fail(e.requirement, param, ctx)


def integer(lo: int | None = None, hi: int | None = MAX_INT) -> Checked:
    """An integer option in [lo, hi] (no floats, no booleans, nothing too large to use)."""
    return Checked("integer", lambda v, name: parse_int(v, name, lo, hi))


def number(lo: float | None = None, hi: float | None = None, **open_ends: bool) -> Checked:
    """A finite number option (``nan``/``inf`` refused) in the range; ``lo_open``/``hi_open`` exclude ends."""
    return Checked("number", lambda v, name: parse_float(v, name, lo=lo, hi=hi, **open_ends))


SEED = integer(0, MAX_SEED)
POSITIVE = integer(1)
COUNT = integer(0)


def model_options(f: Callable) -> Callable:
    """--model, --dtype, --device."""
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
        help="smollm2-135m (embedded), a .gguf file, a model directory or a hub id.",
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

    from selfextend.models import load_model
    from selfextend.patch import apply_self_extend
    from selfextend.quantize import apply_weight_format

    if (group_size is None) != (window is None):
        raise click.UsageError("Self-Extend needs both --group-size and --window")
    transformers.utils.logging.disable_progress_bar()
    lm, tokenizer = load_model(model, dtype=dtype, device=device)
    apply_weight_format(lm, weights)
    if group_size is not None:
        apply_self_extend(lm, group_size, window)
    return lm, tokenizer

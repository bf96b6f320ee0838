"""Options shared by several commands, and the model loading they lead to."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

import click


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be so that every command stops the same way (summary, output
    flushed); an interrupted sweep then exits 143 (128 + SIGTERM) where Ctrl-C's is 130."""


def interrupt_status(e: BaseException | None) -> int:
    """The shell's exit status for a stop by ``e``: 143 for SIGTERM, 130 for Ctrl-C."""
    return 143 if isinstance(e, Terminated) else 130


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


OPENMP_WAITS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # how libgomp's idle threads wait, read at its load
QUIETED: list[str] = []  # the variables quiet_openmp_waits set in this process (not the user's)


def quiet_openmp_waits(environ: MutableMapping[str, str]) -> bool:
    """Set ``GOMP_SPINCOUNT=10000`` in ``environ`` (the process's, before torch loads libgomp, which reads
    it once) unless the user set either variable of :data:`OPENMP_WAITS` or torch is loaded already (too
    late: nothing is changed). Returns whether it set it.

    Why: by default libgomp's workers spin up to 300,000 rounds after each parallel loop before sleeping.
    A decode token runs hundreds of short loops, so on a machine with other work the spinning threads
    take the cores the working ones need (the issue's report: 3.4 tokens/s with two threads beside a
    build, 50 with one). A short spin keeps the quiet machine's rate (a worker is still spinning when the
    next loop starts) and lets a worker sleep soon beside other work; sleeping at once
    (``OMP_WAIT_POLICY=PASSIVE``) cost 2.4x on a quiet machine (experiments/speed/threads_under_load.py,
    docs/bench.md)."""
    if "torch" in sys.modules or any(name in environ for name in OPENMP_WAITS):
        return False
    environ["GOMP_SPINCOUNT"] = "10000"
    QUIETED.append("GOMP_SPINCOUNT")
    return True


def without_our_waits(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less what :func:`quiet_openmp_waits` set: for another program (llama-server), which
    should wait as it does by default, not as we do; a value the user set stays."""
    return {k: v for k, v in environ.items() if k not in QUIETED}


MAX_THREADS = 1024  # -t 100000 made the tokenizer's thread pool panic, then a segmentation fault


def _set_threads(ctx: click.Context, param: click.Parameter, value: int | None) -> None:
    if value is not None:
        import torch

        torch.set_num_threads(value)


def threads_option(f: Callable) -> Callable:
    """--threads: torch's intra-op CPU threads, set while the command line is parsed."""
    return click.option(
        "-t",
        "--threads",
        type=integer(1, hi=MAX_THREADS),
        default=None,
        expose_value=False,
        callback=_set_threads,
        help="CPU threads for the model's arithmetic (default: what torch picks, usually one per core). "
        "Idle threads spin briefly, then sleep (GOMP_SPINCOUNT=10000 unless OMP_WAIT_POLICY or "
        "GOMP_SPINCOUNT is set), so other work on the machine slows them less.",
    )(f)


def gguf_must_exist(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A model named as a ``.gguf`` file that is not there is refused at once, before the seconds of
    importing torch and transformers that resolving it would cost (``resolve_model`` applies the same
    rule, with the same message, to callers of the library)."""
    from selfextend.core.paths import gguf_file_problem

    problem = (
        gguf_file_problem(value.strip())
        if value is not None and value.strip().lower().endswith(".gguf")
        else None
    )
    if problem is not None:
        raise click.BadParameter(problem, ctx, param)
    return value


def in_writable_folder(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A file to write, refused at once where its folder is missing or not writable (found otherwise when
    the first token was written, after the seconds of loading the model)."""
    if value is not None:
        folder = Path(value).expanduser().absolute().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise click.BadParameter(f"no writable folder {folder} to write it in", ctx, param)
    return value


def replaceable_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A file written whole at the end (a chat's session), refused at once where it could not be: a missing
    or unwritable folder, a read-only file, a folder's name (found otherwise after the conversation)."""
    from selfextend.core.paths import cannot_replace

    value = in_writable_folder(ctx, param, value)
    problem = None if value is None else cannot_replace(value)
    if problem is not None:
        raise click.BadParameter(f"{value}: {problem.strerror}", ctx, param)
    return value


def results_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A results file to append to, refused at once where it could not be written (found otherwise after
    the first point was measured, and that point lost): an empty name, something other than a file, a file
    or nearest existing folder not writable, a name that cannot be created there (tried: an existing file
    opened to append, or the folders made now, the file made and removed; as root every file and folder
    passes ``os.access``, /proc too)."""
    if value is None:
        return value
    path = Path(value).expanduser().absolute()
    if not value.strip():
        raise click.BadParameter("names no file", ctx, param)
    if path.exists():
        if not path.is_file():
            raise click.BadParameter(f"{value} is not a regular file", ctx, param)
        if not os.access(path, os.W_OK):
            raise click.BadParameter(f"{value} is not writable", ctx, param)
        try:  # as root os.access passes every file: /proc/version opens for reading only
            with path.open("ab"):
                pass
        except OSError as e:
            raise click.BadParameter(f"cannot append to {value}: {e.strerror or e}", ctx, param) from None
        return value
    folder = next(p for p in path.parents if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise click.BadParameter(f"no writable folder {folder} to write it in", ctx, param)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("x"):
            pass
        path.unlink()
    except FileExistsError:  # made meanwhile (another process of a launched sweep): it is writable
        pass
    except OSError as e:
        raise click.BadParameter(f"cannot create {value}: {e.strerror or e}", ctx, param) from None
    return value


def dtype_default(device: str, device_map: str | None) -> str:
    """--dtype's default on ``device`` (or over ``device_map``'s devices), as the option spells it."""
    from selfextend.models import default_dtype

    return str(default_dtype(device, device_map)).removeprefix("torch.")


def _device_dtype(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    """--dtype as given (a name torch does not know refused now, not after the model has loaded), else the
    default for --device (or --device-map; both read first, being eager)."""
    if value is not None:
        from selfextend.models.diskcache import parse_dtype

        try:
            parse_dtype(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        return value
    return dtype_default(ctx.params.get("device", "cpu"), ctx.meta.get("device_map"))


def model_options(f: Callable) -> Callable:
    """--model, --dtype, --device, --threads."""
    f = threads_option(f)
    f = click.option(
        "--device",
        default="cpu",
        show_default=True,
        is_eager=True,  # read before --dtype, whose default follows it
        help="torch device: cpu, cuda, cuda:1, mps.",
    )(f)
    f = click.option(
        "--dtype",
        default=None,
        callback=_device_dtype,
        help="Weights and activations: float32, bfloat16, float16, or auto (a checkpoint's own dtype; "
        "float32 for a GGUF). Default: float32 on the CPU, bfloat16 on a GPU (float16 on one older than "
        "compute capability 8.0).",
    )(f)
    f = click.option(
        "-m",
        "--model",
        default="smollm2-135m",
        show_default=True,
        callback=gguf_must_exist,
        help="smollm2-135m (embedded), gemma3-270m (the gemma extra), a .gguf file, a model directory "
        "or a hub id.",
    )(f)
    return f


def parallel_option(default: int) -> Callable[[Callable], Callable]:
    """-np/--parallel: a server's slots (``serve``; ``bench``'s server case gives both servers the same)."""
    return click.option(
        "-np",
        "--parallel",
        type=POSITIVE,
        default=default,
        show_default=True,
        help="Slots: requests served at once.",
    )


def cache_reuse_option(f: Callable) -> Callable:
    """--cache-reuse: the smallest reused chunk (``serve``; ``bench``'s server case, llama-server's too)."""
    return click.option(
        "--cache-reuse",
        type=COUNT,
        default=256,
        show_default=True,
        help="Reuse chunks of at least this many cached tokens that reappear later in a new prompt, moved by "
        "K-shift instead of recomputed (0: the common prefix only).",
    )(f)


def weights_option(default: str) -> Callable[[Callable], Callable]:
    """--weights: auto, float (the model's dtype), int8 (weight-only, a quarter of float32's bytes), int4
    (a GGUF's own 4-bit blocks, repacked) or gguf (a GGUF's blocks as stored). The choices are ``auto``
    and ``quantize.WEIGHT_FORMATS``, not imported here so that ``--help`` stays quick (tests/test_int4.py
    holds them equal)."""
    return click.option(
        "--weights",
        type=click.Choice(["auto", "float", "int8", "int4", "gguf"]),
        default=default,
        show_default=True,
        help="Linear-layer weights: auto (on the CPU: gguf for a GGUF, int4 there without a C compiler, "
        "int8 otherwise; on a GPU: float), float (as --dtype; a GGUF dequantized at load), "
        "int8 (per-row weight-only, bfloat16 products; decoding reads 4x fewer bytes than float32), int4 "
        "(a GGUF's Q4_0/Q4_1/Q4_K weights repacked into torch's int4 layout) or gguf (a GGUF's matrices as "
        "stored, native dot products: Q4_0-Q8_0, Q2_K-Q6_K, IQ4_NL/IQ4_XS, F16, BF16); int4 and gguf "
        "hold other linear layers int8 (a non-GGUF model: all int8).",
    )


def run_name(model: str, weights: str, device: str | object = "cpu") -> str:
    """The model's name in result records: int8 weights are another model for resuming and plotting
    (``auto`` is named by the form it means for ``model`` on ``device``)."""
    if weights == "auto":
        import torch

        from selfextend.models.load import auto_weights
        from selfextend.models.sources import resolve_model

        weights = auto_weights(weights, resolve_model(model), torch.device(str(device)))
    return model if weights == "float" else f"{model}+{weights}"


def model_of_run_name(name: str) -> str:
    """The model a :func:`run_name` names, its ``+weights`` form taken off (a results file's records name
    ``smollm2-135m+int8``; the model to read a config from is ``smollm2-135m``)."""
    from selfextend.models.quantize import WEIGHT_FORMATS

    model, plus, form = name.rpartition("+")
    return model if plus and model and form in WEIGHT_FORMATS else name


def self_extend_options(
    f: Callable | None = None, *, group_size: int | None = None, window: int | None = None
) -> Callable:
    """-g/--group-size and -w/--window, the one definition every command uses. Without defaults both or
    neither turn Self-Extend on; ``info`` and ``bench`` default to G=4, W=1024 (what they report on)."""

    def add(f: Callable) -> Callable:
        f = click.option(
            "-w",
            "--window",
            type=POSITIVE,
            default=window,
            show_default=window is not None,
            help="Self-Extend neighbor window W in tokens (exact positions inside it).",
        )(f)
        return click.option(
            "-g",
            "--group-size",
            type=POSITIVE,
            default=group_size,
            show_default=group_size is not None,
            help="Self-Extend group size G: positions beyond the window are floor-divided by G.",
        )(f)

    return add if f is None else add(f)


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # as models.load's (test_device_map)


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
        is_eager=True,  # read before --dtype, whose default follows it
        callback=remember,
        help="Place the layers of a model too big for one device over several (accelerate's device_map; "
        "auto: GPUs first, then CPU memory, then disk). Replaces --device; float weights only "
        "(--weights auto is float with it). Multi-GPU placement is untested.",
    )(f)


def checked_self_extend(group_size: int, window: int, trained: int | None) -> tuple[int, int]:
    """G and W as :func:`~selfextend.core.positions.validate` takes them for a model trained on ``trained``
    tokens; its refusal a usage error naming the option, so the line points to the command's --help."""
    from selfextend.core.positions import validate
    from selfextend.core.validate import ValidationError

    try:
        return validate(group_size, window, trained)
    except ValidationError as e:
        option = {"window": "-w/--window", "group size": "-g/--group-size"}.get(e.name)
        if option is None:
            raise
        raise click.UsageError(f"{option} {e.requirement}") from None


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

    from selfextend.hf.facts import trained_window
    from selfextend.hf.patch import apply_self_extend
    from selfextend.models import load_model

    if (group_size is None) != (window is None):
        raise click.UsageError("Self-Extend needs both --group-size and --window")
    ctx = click.get_current_context(silent=True)
    device_map = ctx.meta.get("device_map") if ctx else None
    if device_map and weights not in ("auto", "float"):
        raise click.UsageError(
            f"--device-map needs float weights (--weights auto or float): {weights} layers are not placed "
            "by accelerate"
        )
    transformers.utils.logging.disable_progress_bar()
    lm, tokenizer = load_model(model, dtype=dtype, device=device, weights=weights, device_map=device_map)
    if group_size is not None:
        checked_self_extend(group_size, window, trained_window(lm.config))
        apply_self_extend(lm, group_size, window)
    return lm, tokenizer

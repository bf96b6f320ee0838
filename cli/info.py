"""``selfextend info MODEL``: the architecture facts that matter for Self-Extend and the KV cache."""

from __future__ import annotations

import click

from selfextend.cli.options import checked_self_extend, gguf_must_exist, self_extend_options

CELL_BYTES = {"bf16": 2, "f32": 4}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _generate_weights(model: str, table) -> list[tuple[str, str]]:
    """Rows naming the weights form ``generate`` picks here by default (``--weights auto`` on the CPU) and,
    for the ``gguf`` form, what it holds of the file's matrices by block type, against the file's bytes."""
    import torch
    from gguf import GGMLQuantizationType

    from selfextend.models.gguf import KEPT_BLOCKS, held_matrices
    from selfextend.models.load import auto_weights
    from selfextend.models.sources import resolve_model

    form = auto_weights("auto", resolve_model(model), torch.device("cpu"))
    rows = [("weights generate uses", f"--weights {form} (auto, on the CPU)")]
    if table is None or form != "gguf":
        return rows
    held = held_matrices(table, KEPT_BLOCKS[form], torch.float32)
    for h in held:
        way = "as stored" if h.stored_as_is else "as int8"
        what = f"{h.matrices} matri{'x' if h.matrices == 1 else 'ces'} {way}"
        if h.embedding:
            what += ", the embedding table among them" if h.matrices > 1 else " (the embedding table)"
        held_here = f"{what}: {_mib(h.held_bytes)} (file {_mib(h.file_bytes)})"
        rows.append((f"  {GGMLQuantizationType(h.kind).name}", held_here))
    total = sum(h.held_bytes for h in held), sum(h.file_bytes for h in held)
    rows.append(("  all matrices", f"{_mib(total[0])} (file {_mib(total[1])})"))
    return rows


def _gpu() -> tuple[str, str]:
    """The row saying what ``--device cuda`` would run here: the GPU torch sees, and whether the fused
    Triton kernels (Self-Extend prefill, the decode step's) take it or the tensor operations run."""
    import torch

    if not torch.cuda.is_available():
        return (
            "GPU",
            "none that torch sees (--device cuda needs one; this torch is " + torch.__version__ + ")",
        )
    from selfextend.core.fused_prefill import AMPERE, compute_capability, kernels_run_on, triton_available

    device = torch.device("cuda")
    cc = compute_capability(device)
    if kernels_run_on(device):
        import triton

        kernels = f"the fused Triton kernels run (triton {triton.__version__})"
    elif not triton_available():
        kernels = "the fused kernels do not run: triton is not installed (pip install triton)"
    else:
        kernels = f"the fused kernels do not run: they need compute capability {AMPERE // 10}.0 or more"
    return (
        "GPU",
        f"{torch.cuda.get_device_name(device)}, compute capability {cc // 10}.{cc % 10}: {kernels}",
    )


def _kv(config, tokens: int, cells: str) -> str:
    """A context-shift cache's bytes at ``tokens`` cells of type ``cells`` (bf16 or f32), and the all-layers
    size where smaller."""
    from selfextend.kv.cache import cache_bytes

    size = CELL_BYTES[cells]
    now, every = (
        cache_bytes(config, tokens, bytes_per_value=size),
        cache_bytes(config, tokens, 0, size, False),
    )
    return f"{_mib(now)} ({cells})" + (f"; {_mib(every)} if every layer held them all" if now < every else "")


def _rope(config, facts) -> str:
    """The RoPE line: each attention kind's where the layers differ (Gemma 3's sliding layers rotate by
    another base than its full ones: both said, the full one first, the one long context reads)."""
    said = f"{facts.rope_type}, theta {facts.rope_theta:g}" if facts.rope_theta else facts.rope_type
    kinds = getattr(getattr(config, "text_config", config), "rope_parameters", None)
    if not isinstance(kinds, dict) or not all(isinstance(v, dict) for v in kinds.values()) or len(kinds) < 2:
        return said
    others = [
        f"{p.get('rope_type', 'default')}, theta {p['rope_theta']:g} ({kind.replace('_', ' ')})"
        for kind, p in kinds.items()
        if kind != "full_attention" and isinstance(p.get("rope_theta"), (int, float))
    ]
    return "; ".join([f"{said} (full attention)", *others])


@click.command()
@click.argument("model_arg", metavar="[MODEL]", required=False, callback=gguf_must_exist)
@click.option(
    "-m",
    "--model",
    "model_opt",
    callback=gguf_must_exist,
    help="The model, as for the other commands (or as the argument MODEL). Default: smollm2-135m.",
)
@self_extend_options(group_size=4, window=1024)
def info(model_arg: str | None, model_opt: str | None, group_size: int, window: int) -> None:
    """Print layers, heads, head dim, RoPE, trained window, weights and KV-cache memory, the
    Self-Extend reach, and the GPU here (whether the fused kernels take it).

    Reads only the config (no weights). Weights: the bytes of the loaded model in each --weights /
    --dtype form (int8: 1 byte per linear weight + a bfloat16 scale per row, the rest float32), and the
    form generate uses by default on the CPU; for a GGUF in the gguf form, the bytes it holds of the
    file's matrices per block type against the file's (a tied head and the embedding table hold one copy
    of the table's blocks, interleaved or not).
    KV bytes are for the cells `generate` uses by default on the CPU in float32 (bf16 where its native
    decode step serves the model, else f32): 2 (K and V) x 2 or 4 bytes x head_dim x kv_heads x layers per
    token; at N tokens, those of a context-shift cache of N cells (--ctx N), whose sliding-window layers
    hold 2 x (window - 1) cells (plus the --keep ones) instead of N.
    """
    import torch

    from selfextend.core.positions import max_length
    from selfextend.generation.settings import NATIVE_CACHE_TYPE, native_cells_default
    from selfextend.kv.cache import sliding_cells
    from selfextend.models import model_facts
    from selfextend.models.gguf_families import check_tensors_fit
    from selfextend.models.load import read_config
    from selfextend.models.sources import resolve_model
    from selfextend.models.weights import RunForm, form_bytes

    if model_arg is not None and model_opt is not None and model_arg != model_opt:
        raise click.UsageError(f"two models given ({model_arg}, {model_opt}): give MODEL or -m/--model")
    model = next((m for m in (model_arg, model_opt) if m is not None), "smollm2-135m")
    config, table = read_config(model)
    if table is not None:
        check_tensors_fit(table, config, resolve_model(model).gguf_path)
    cells = NATIVE_CACHE_TYPE if native_cells_default(config, "cpu", torch.float32) else "f32"
    facts = model_facts(config)
    trained = facts.trained_window
    defaulted = (
        click.get_current_context().get_parameter_source("window") == click.core.ParameterSource.DEFAULT
    )
    if defaulted and trained and window >= trained:  # a model trained on 1,024 tokens or fewer: half of them
        window = trained // 2
    group_size, window = checked_self_extend(group_size, window, trained)
    rows = [
        ("model", f"{model} ({facts.model_type})"),
        ("layers", facts.layers),
        ("attention heads", facts.heads),
        (
            "KV heads",
            f"{facts.kv_heads} (GQA, {facts.heads // facts.kv_heads} query heads per KV head)"
            if facts.kv_heads != facts.heads
            else facts.kv_heads,
        ),
        ("head dim", f"{facts.head_dim} (rotary dims {facts.rotary_dim})"),
        ("RoPE", _rope(config, facts)),
        ("trained window", f"{trained} tokens"),
        ("vocab", facts.vocab_size),
        (
            "KV cache per token",
            f"{facts.kv_bytes_per_token(CELL_BYTES[cells]):,} bytes ({cells}, generate's default cells)"
            + ("" if cells == "f32" else f", {facts.kv_bytes_per_token(4):,} (f32)"),
        ),
        (f"KV cache at {trained} tokens", _kv(config, trained, cells)),
        (
            "weights in memory",
            ", ".join(
                f"{_mib(form_bytes(config, RunForm(weights, dtype)))} ({label})"
                for label, weights, dtype in (
                    ("--weights int8", "int8", torch.float32),
                    ("float32", "float", torch.float32),
                    ("bfloat16", "float", torch.bfloat16),
                )
            ),
        ),
    ]
    rows += _generate_weights(model, table)
    kinds = list(getattr(config.get_text_config(), "layer_types", None) or [])
    sliding = kinds.count("sliding_attention")
    if sliding:
        window_tokens = config.get_text_config().sliding_window
        rows.append(
            (
                "attention layers",
                f"{len(kinds) - sliding} full (Self-Extend applies to these), {sliding} sliding over "
                f"{window_tokens} tokens (keep their own attention; the KV cache holds at most "
                f"{sliding_cells(window_tokens, 0):,} cells of each)",
            )
        )
    if trained:
        reach = max_length(trained, group_size, window)
        rows += [
            (
                f"Self-Extend G={group_size} W={window}",
                f"up to {reach:,} tokens ({reach / trained:.1f}x the window)",
            ),
            (f"KV cache at {reach:,} tokens", _kv(config, reach, cells)),
        ]
    rows.append(_gpu())
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")

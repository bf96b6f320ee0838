"""check.py's 8b section, second half: the engine's paths run with the Llama-3.1-8B shape on the GPU, each
against the same model on the CPU to bfloat16's tolerance (issue 48: "generate (with a context shift),
serve with 2 slots, ppl and passkey each run on --device cuda ... with the 8B shape; their outputs equal the
CPU path's to bf16 tolerance"; chat the same).

Random weights give near-flat logits, so two devices' greedy tokens part at the first near-tie: the CPU is
fed the GPU's tokens (teacher forcing) and the logits of every step are compared, as the largest difference
over the largest logit. The CPU copy of the model takes about 16 GB of host memory and a few seconds a
token (14 tokens a run: 8 to the shift, 6 after). ``chat`` takes the default model's tokenizer and chat
template (``.gpu/tiny``'s, else the installed default model's): its 49,152 ids are all rows of the shape's
128,256; the ids past them that the random model picks decode to no text, as a padded vocabulary's do.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer

from selfextend.chat.session import ChatSession
from selfextend.evaluation.methods import Method, applied, parse_method
from selfextend.evaluation.nll import token_nll
from selfextend.evaluation.passkey import answer
from selfextend.generation.batched import BatchedDecode
from selfextend.generation.generator import Generator
from selfextend.kv.cache import ContextShiftCache

CTX, KEEP, PROMPT_LEN, TOKENS = 64, 4, 56, 14  # a context shift after 8 tokens
TOLERANCE = 2e-2  # bfloat16 keeps 8 bits; 32 layers of differently ordered sums
CHAT_CTX, CHAT_TOKENS = 64, 8  # the second turn shifts the first exchange out
TURNS = ("Hello! What is a rotary position embedding?", "And what does a context shift drop?")
TINY = Path(__file__).resolve().parents[2] / ".gpu" / "tiny"  # prepare.sh's tiny model: the tokenizer


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of two logit rows over the larger's largest magnitude (both as float32)."""
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / max(a.abs().max(), b.abs().max()))


def _generator(model: torch.nn.Module) -> Generator:
    return Generator(model, ContextShiftCache(model, CTX, n_keep=KEEP, dtype=torch.bfloat16))


def _teacher_forced(gpu: torch.nn.Module, cpu: torch.nn.Module, prompt: list[int]) -> tuple[float, int]:
    """Greedy tokens on the GPU through the context shifts; the CPU written the same tokens. The worst
    relative logit difference over the steps, and the GPU cache's shifts."""
    a, b = _generator(gpu), _generator(cpu)
    la, lb = a.feed(prompt), b.feed(prompt)
    worst = _relative(la, lb)
    for _ in range(TOKENS):
        token = int(la.argmax())
        la, lb = a.write([token]), b.write([token])
        worst = max(worst, _relative(la, lb))
    return worst, a.cache.shifts


def _slot_times(model: torch.nn.Module, prompt: list[int]) -> dict[str, float]:
    """Milliseconds a step for two slots: both in one replay of the captured step (what the server takes on
    a GPU: ``BatchedDecode``), both in one uncaptured pass of the direct step's rows (what it took before),
    and each written alone (a replay each); median of 16 steps after 4."""
    out = {}
    batched = BatchedDecode(model)
    ways = {
        "captured_rows_ms": lambda gens, t: batched([(x, t) for x in gens]),
        "direct_rows_ms": lambda gens, t: gens[0].step.rows([t, t], [x.cache for x in gens]),
        "alone_ms": lambda gens, t: [x.write([t]) for x in gens],
    }
    for label, step in ways.items():
        gens = [_generator(model) for _ in range(2)]
        for x in gens:
            x.feed(prompt[:20])
        times = []
        for i in range(20):
            for x in gens:
                x.make_room(1)
            start = time.perf_counter()
            step(gens, 100 + i)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        out[label] = round(statistics.median(times[4:]), 2)
    return out


def runs(
    report: Callable[..., None],
    gpu_model: torch.nn.Module,
    gpu: str,
    group: int,
    window: int,
    guarded: Callable[..., None],
    slots: bool = True,
    cpu_copy: bool = True,
) -> None:
    """The 8B shape's runs on ``gpu_model``'s device: two slots (``slots``), then those against a CPU copy
    (``cpu_copy``; ``group``/``window``: Self-Extend's setting for this short context), each through
    ``guarded`` (one that raises is reported, the next runs)."""
    vocab = gpu_model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(100, vocab - 1, (PROMPT_LEN,), generator=g).tolist()
    spec = f"selfextend:G={group},W={window}"
    if slots:
        with applied(gpu_model, parse_method(spec)):  # the slots' rows through Self-Extend's grouped cells
            guarded("8b two slots", _two_slots, report, gpu_model, prompt, gpu)
            guarded("8b two slots ms a step", _report_slot_times, report, gpu_model, prompt, gpu)
    if not cpu_copy:
        return
    device = next(gpu_model.parameters()).device
    cpu = copy.deepcopy(gpu_model).to("cpu") if device.type != "cpu" else copy.deepcopy(gpu_model)
    for se in (False, True):
        name = "8b generate" + (f" self-extend G={group} W={window}" if se else "")
        guarded(
            name, _generate, report, name, gpu_model, cpu, prompt, parse_method(spec) if se else None, gpu
        )
    for method in ("plain", spec):
        guarded(f"8b ppl {method}", _ppl, report, gpu_model, cpu, prompt, method, gpu)
    guarded(f"8b passkey answer {spec}", _passkey, report, gpu_model, cpu, prompt, spec, gpu)
    guarded("8b chat", _chat, report, gpu_model, cpu, gpu)
    del cpu


def _generate(
    report: Callable[..., None],
    name: str,
    gpu_model: torch.nn.Module,
    cpu: torch.nn.Module,
    prompt: list[int],
    method: Method | None,
    gpu: str,
) -> None:
    """Greedy through a context shift on the GPU, the CPU teacher-forced, under ``method`` (None: plain)."""
    if method is None:
        worst, shifts = _teacher_forced(gpu_model, cpu, prompt)
    else:
        with applied(gpu_model, method), applied(cpu, method):
            worst, shifts = _teacher_forced(gpu_model, cpu, prompt)
    ok = worst < TOLERANCE and shifts >= 1
    report(name, ok=ok, worst_relative_logit=f"{worst:.1e}", shifts=shifts, gpu=gpu)


def _two_slots(report: Callable[..., None], gpu_model: torch.nn.Module, prompt: list[int], gpu: str) -> None:
    """Two slots in one forward (the server's batched step) against each written alone, on the GPU, each
    through a shift."""
    batched = BatchedDecode(gpu_model, shared_from=2)
    gens, alone = [_generator(gpu_model) for _ in range(2)], [_generator(gpu_model) for _ in range(2)]
    logits = [x.feed(prompt[:n]) for x, n in zip(gens, (56, 52), strict=True)]
    solo = [x.feed(prompt[:n]) for x, n in zip(alone, (56, 52), strict=True)]
    steps = []  # each step's worst of the two slots: flat (rounding) or rising at the shift (a fault)
    for _ in range(TOKENS):
        tokens = [int(x.argmax()) for x in logits]
        logits = batched(list(zip(gens, tokens, strict=True)))
        solo = [x.write([t]) for x, t in zip(alone, tokens, strict=True)]
        steps.append(max(_relative(x, y) for x, y in zip(logits, solo, strict=True)))
    shifts = [x.cache.shifts for x in gens]
    worst = max(steps)
    ok = worst < TOLERANCE and min(shifts) >= 1
    report(
        "8b two slots",
        ok=ok,
        worst_relative_logit=f"{worst:.1e}",
        per_step=[f"{x:.0e}" for x in steps],
        shifts=shifts,
        gpu=gpu,
    )


def _report_slot_times(
    report: Callable[..., None], gpu_model: torch.nn.Module, prompt: list[int], gpu: str
) -> None:
    report("8b two slots ms a step", gpu=gpu, **_slot_times(gpu_model, prompt))


def _ppl(
    report: Callable[..., None],
    gpu_model: torch.nn.Module,
    cpu: torch.nn.Module,
    prompt: list[int],
    spec: str,
    gpu: str,
) -> None:
    """``ppl``'s per-token scores of the prompt under ``spec`` on both devices."""
    ids = torch.tensor([prompt])
    device = next(gpu_model.parameters()).device
    with applied(gpu_model, parse_method(spec)), applied(cpu, parse_method(spec)):
        a, b = token_nll(gpu_model, ids.to(device)), token_nll(cpu, ids)
    diff = float((a.float().cpu() - b.float()).abs().max())
    report(f"8b ppl {spec}", ok=diff < 0.05, max_abs_nll_difference=f"{diff:.1e}", gpu=gpu)


def _passkey(
    report: Callable[..., None],
    gpu_model: torch.nn.Module,
    cpu: torch.nn.Module,
    prompt: list[int],
    spec: str,
    gpu: str,
) -> None:
    """``passkey``'s greedy answer on both devices: where they part is said (random weights: near-ties)."""
    a, b = answer(gpu_model, prompt, parse_method(spec)), answer(cpu, prompt, parse_method(spec))
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    same = min(len(a), len(b)) if same is None and len(a) != len(b) else same
    report(f"8b passkey answer {spec}", tokens=len(a), first_difference=same, gpu=gpu)


def _tokenizer():
    """The default model's tokenizer: the copy prepare.sh carries (a GPU machine has no gguf to read the
    default model's file), else the installed default model's."""
    if TINY.exists():
        return AutoTokenizer.from_pretrained(TINY)
    from selfextend.models import ensure_converted, resolve_model

    return AutoTokenizer.from_pretrained(ensure_converted(resolve_model("smollm2-135m")))


def _chat_turns(model: torch.nn.Module, tokenizer, forced: list[int] | None = None):
    """Two chat turns through a shift, greedy (or ``forced``: the tokens to write, teacher forcing): every
    step's logits on the host, the tokens, the replies' texts and the cache's shifts."""
    session = ChatSession(model, tokenizer, CHAT_CTX, max_new_tokens=CHAT_TOKENS, ignore_eos=True)
    seen: list[torch.Tensor] = []
    tokens: list[int] = []
    greedy = session.gen.next_token

    def next_token(logits: torch.Tensor) -> int:
        seen.append(logits.float().cpu())
        tokens.append(greedy(logits) if forced is None else forced[len(tokens)])
        return tokens[-1]

    session.gen.next_token = next_token  # the session's one choice of a token, recorded
    replies = ["".join(session.reply(text)) for text in TURNS]
    return seen, tokens, replies, session.cache.shifts


def _chat(report: Callable[..., None], gpu_model: torch.nn.Module, cpu: torch.nn.Module, gpu: str) -> None:
    """``chat``'s session on the GPU (greedy) and on the CPU written the same tokens: every step's logits
    to bfloat16's tolerance, the same replies' text and shifts."""
    tokenizer = _tokenizer()
    a_logits, tokens, a_replies, a_shifts = _chat_turns(gpu_model, tokenizer)
    b_logits, _, b_replies, b_shifts = _chat_turns(cpu, tokenizer, forced=tokens)
    worst = max(_relative(x, y) for x, y in zip(a_logits, b_logits, strict=True))
    ok = worst < TOLERANCE and a_replies == b_replies and a_shifts == b_shifts >= 1
    report(
        "8b chat", ok=ok, worst_relative_logit=f"{worst:.1e}", tokens=len(tokens), shifts=a_shifts, gpu=gpu
    )

"""The static decode step a GPU captures as a CUDA graph (generation/graphed.py), run eagerly here: every
cell of the buffers read, the cells not in use masked by position. Its logits equal the direct step's
through context shifts (plain, Self-Extend, Gemma 3's sliding layers), and it makes no host tensor that a
GPU would refuse (tests/device_guard.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tiny_gemma3
from device_guard import DeviceGuard
from graph_replay import recorded

import selfextend.generation.decode as decode_module
from selfextend.generation.backends import decode_backends
from selfextend.generation.compiled import FastDecode
from selfextend.generation.decode import DecodeStep
from selfextend.generation.generator import Generator
from selfextend.generation.graphed import GraphedDecode, graphed_decode_for
from selfextend.hf.patch import apply_self_extend
from selfextend.kv.cache import ContextShiftCache

PROMPT = list(range(3, 30))


def _model(family: str, self_extend: bool) -> torch.nn.Module:
    if family == "gemma3":
        model = tiny_gemma3(["sliding_attention", "full_attention"], 8)
    else:
        model = make_model(family)
    if self_extend:
        apply_self_extend(model, group_size=4, window=16)
    return model


def _greedy(
    model: torch.nn.Module, graphed: bool, n: int = 50, capture=False
) -> tuple[list[torch.Tensor], int, int]:
    """Logits of ``n`` greedy steps through a 40-cell cache, the static step's count and the shifts
    (``capture``: how GraphedDecode records its step; False: eagerly)."""
    gen = Generator(model, ContextShiftCache(model, 40, n_keep=4, dtype=torch.float32))
    if graphed:
        gen.fast = GraphedDecode(model, capture=capture, notify=pytest.fail)
    served = 0
    if graphed:
        call = gen.fast.__call__

        def counted(token, cache):
            nonlocal served
            out = call(token, cache)
            served += out is not None
            return out

        gen.fast = counted
    logits = gen.feed(PROMPT)
    out = []
    for _ in range(n):
        logits = gen.write([int(logits.argmax())])
        out.append(logits)
    return out, served, gen.cache.shifts


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("self_extend", [False, True], ids=["plain", "self-extend"])
def test_the_static_step_is_the_direct_steps_math(family: str, self_extend: bool) -> None:
    model = _model(family, self_extend)
    want, _, shifts = _greedy(model, graphed=False)
    got, served, _ = _greedy(model, graphed=True)
    assert shifts >= 2 and served >= 40  # the static step served nearly every token, across shifts
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("self_extend", [False, True], ids=["plain", "self-extend"])
def test_the_captured_step_replays_the_direct_steps_math(family: str, self_extend: bool) -> None:
    """Recorded once per cache and replayed for every later token (tests/graph_replay.py: every value read
    on the host fixed at capture, as in a CUDA graph), through context shifts: what a GPU runs."""
    model = _model(family, self_extend)
    want, _, _ = _greedy(model, graphed=False)
    captures = []

    def capture(run):
        captures.append(recorded(run))
        return captures[-1]

    got, served, shifts = _greedy(model, graphed=True, capture=capture)
    assert shifts >= 2 and served >= 40 and len(captures) == 1  # one capture served every token
    assert len(captures[0][0].calls) > 100
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=2e-5, rtol=1e-5)


def test_a_weight_replaced_between_prompts_is_read(monkeypatch) -> None:
    """A captured step replays what it read at capture (a CUDA graph: the weights' addresses; the stand-in:
    the tensors), so a weight replaced by another tensor (a library user's edit, ``model.to``) would be read
    stale, or as freed memory on a GPU. The generator's next prompt makes its steps again: its logits then
    equal a generator's that reads the modules live (the direct step on the CPU)."""
    import selfextend.generation.backends as backends

    model = _model("llama", True)
    live = Generator(model, ContextShiftCache(model, 40, n_keep=4, dtype=torch.float32))
    monkeypatch.setattr(backends, "graphed_decode_for", lambda m: GraphedDecode(m, capture=recorded))
    gen = Generator(model, ContextShiftCache(model, 40, n_keep=4, dtype=torch.float32))
    assert live.fast is None and isinstance(gen.fast, GraphedDecode)

    def both(prompt: list[int], n: int = 3) -> float:
        a, b = gen.feed(prompt), live.feed(prompt)
        worst = float((a - b).abs().max())
        for _ in range(n):
            token = int(b.argmax())
            a, b = gen.write([token]), live.write([token])
            worst = max(worst, float((a - b).abs().max()))
        return worst

    assert both(PROMPT) < 2e-5  # captured at the first token, then replayed
    captured = gen.fast
    for layer in model.model.layers:
        o = layer.self_attn.o_proj
        o.weight = torch.nn.Parameter(2 * o.weight, requires_grad=False)
    assert both([7, 8, 9]) < 2e-5 and gen.fast is not captured


def test_a_step_reading_the_host_is_not_captured(monkeypatch) -> None:
    """What the replay stand-in catches: a position taken from the cache as a Python int is right eagerly
    and baked into the recording; reading a device value on the host cannot be captured (said, run
    eagerly)."""
    model = _model("llama", False)
    want, _, _ = _greedy(model, graphed=False, n=10)  # before a shift (which would refuse the cells)
    run = GraphedDecode._run

    def baked(self, io, caches, grouped, stored):  # the position as the host knows it, not from io
        pos = torch.full_like(io[1:2], caches[0].n_past)
        return run(self, torch.cat([io[:1], pos, io[2:]]), caches, grouped, stored)

    monkeypatch.setattr(GraphedDecode, "_run", baked)
    eager, _, _ = _greedy(model, graphed=True, n=10)
    torch.testing.assert_close(torch.stack(eager), torch.stack(want), atol=2e-5, rtol=1e-5)
    replayed, _, _ = _greedy(model, graphed=True, n=10, capture=recorded)
    assert (torch.stack(replayed) - torch.stack(want)).abs().max() > 1e-2

    def synced(self, io, caches, grouped, stored):
        assert int(io[1]) == caches[0].n_past  # a host read of a device value
        return run(self, io, caches, grouped, stored)

    monkeypatch.setattr(GraphedDecode, "_run", synced)
    said = []
    gen = Generator(model, ContextShiftCache(model, 40, n_keep=4, dtype=torch.float32))
    gen.fast = GraphedDecode(model, capture=recorded, notify=said.append)
    gen.feed(PROMPT)
    gen.write([5])
    assert len(said) == 1 and "not captured" in said[0] and "_local_scalar_dense" in said[0]
    assert gen.fast.capture is False


def test_capture_and_replay_run_with_the_caches_device_current(monkeypatch) -> None:
    """A CUDA graph records the current device's stream and replays on it: a model on cuda:1 with cuda:0
    current would run its kernels eagerly past the capture (an empty graph, the same logits every token).
    Each capture and replay runs inside the caches' device made current (on_device, recorded here: the
    CPU has no current device)."""
    import contextlib

    import selfextend.generation.graphed as graphed_module

    current: list[torch.device] = []

    @contextlib.contextmanager
    def on_device(device):
        current.append(device)
        yield
        current.pop()

    seen = []

    class Graph:
        def __init__(self, graph):
            self.graph = graph

        def replay(self):
            seen.append(("replay", list(current)))
            self.graph.replay()

    def capture(run):
        seen.append(("capture", list(current)))
        graph, logits = recorded(run)
        return Graph(graph), logits

    monkeypatch.setattr(graphed_module, "on_device", on_device)
    model = _model("llama", False)
    _greedy(model, graphed=True, n=5, capture=capture)
    cpu = [torch.device("cpu")]
    assert seen[0] == ("capture", cpu) and seen[1:] and all(x == ("replay", cpu) for x in seen[1:]), seen


def test_the_static_step_makes_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the guard, with the native kernels off as on a GPU (the direct step takes the tokens the
    static one leaves: a layer's last free slot)."""
    monkeypatch.setattr(decode_module, "native_kernels", lambda: None)
    model = _model("llama", True)
    with DeviceGuard(model) as guard:
        _greedy(model, graphed=True, n=30)
    guard.check()


def test_it_is_the_gpu_path_only() -> None:
    """On the CPU the generator keeps its direct step (graphs are a GPU's); a dynamic RoPE is not served."""
    model = make_model("llama")
    assert graphed_decode_for(model) is None
    assert Generator(model, ContextShiftCache(model, 40)).fast is None


def test_one_gate_picks_the_steps(monkeypatch) -> None:
    """decode_backends: the direct step for rows; for single tokens the compiled step where asked, else the
    captured one (asked for a model it would take on a GPU: here, a stand-in for the CUDA check), else none;
    nothing with direct decoding off."""
    import selfextend.generation.backends as backends

    model = make_model("llama")
    rows, single = decode_backends(model)
    assert isinstance(rows, DecodeStep) and single is None  # the CPU: no graph
    monkeypatch.setattr(backends, "graphed_decode_for", lambda m: GraphedDecode(m, capture=False))
    assert isinstance(decode_backends(model).single, GraphedDecode)
    compiled = decode_backends(model, compile=True).single
    assert isinstance(compiled, FastDecode) and not isinstance(compiled, GraphedDecode)
    assert decode_backends(model, direct=False) == (None, None)
    gen = Generator(model, ContextShiftCache(model, 40))
    assert isinstance(gen.step, DecodeStep) and isinstance(gen.fast, GraphedDecode)


def test_the_servers_slots_step_through_the_captured_step(tiny, monkeypatch) -> None:
    """On a GPU the server's slots share the captured step: one slot's token is a replay of its graph, two
    slots' tokens one replay of theirs (they stepped through the direct step, launched from Python token
    by token, because the slots' generators were made without the single-token step). Here a stand-in for
    the CUDA check; the logits those of the CPU's engine."""
    import selfextend.generation.backends as backends
    from selfextend.server.engine import Engine

    model, tok = tiny
    engines = {"direct": Engine(model, tok, n_ctx=48, parallel=2)}
    stand_in = GraphedDecode(model, capture=False, notify=pytest.fail)
    monkeypatch.setattr(backends, "graphed_decode_for", lambda m: stand_in)
    engines["graphed"] = Engine(model, tok, n_ctx=48, parallel=2)
    served = {"single": 0, "rows": 0}
    single, rows = stand_in.__call__, stand_in.rows

    def counted(kind, call):
        def run(*args):
            out = call(*args)
            served[kind] += out is not None
            return out

        return run

    monkeypatch.setattr(GraphedDecode, "__call__", lambda self, *a: counted("single", single)(*a))
    monkeypatch.setattr(stand_in, "rows", counted("rows", rows))
    logits = {}
    for name, engine in engines.items():
        gens = [slot.generator(4) for slot in engine.slots]
        a, b = gens[0].feed(list(range(200, 230))), gens[1].feed(list(range(300, 320)))
        out = []
        for _ in range(24):  # through a context shift of the first slot
            a, b = engine.batched([(gens[0], int(a.argmax())), (gens[1], int(b.argmax()))])
            out += [a, b]
        for _ in range(3):
            a = gens[0].write([int(a.argmax())])  # one slot alone
            out.append(a)
        logits[name] = torch.stack(out)
        assert gens[0].cache.shifts >= 1
    # every single token and nearly every pair in one replay (a token that would take a layer's last slot
    # goes the other way: there is none here but at a shift); a single token is a one-row replay
    assert served["single"] == 3 and served["rows"] - served["single"] >= 20, served
    assert all(slot.generator(4).fast is stand_in for slot in engines["graphed"].slots)
    torch.testing.assert_close(logits["graphed"], logits["direct"], atol=2e-5, rtol=1e-5)


def test_a_graph_is_keyed_by_every_buffer_it_reads() -> None:
    """A cache's positions are read by its graph as its keys and values are: a layer given another
    positions buffer (a slot's cache made again) is another graph, not a replay reading the freed one."""
    model = make_model("llama")
    cache = ContextShiftCache(model, 40, n_keep=4)
    graphed = GraphedDecode(model, capture=False)
    key = graphed._key([cache], [None], [[]])
    cache.layers[1].positions = cache.layers[1].positions.clone()
    assert graphed._key([cache], [None], [[]]) != key

"""A model whose layers a device map placed apart, with accelerate's hooks active: Self-Extend and the
context-shift cache give what they give on the model in one piece.

On this CPU-only machine the second layer group is offloaded to disk (its weights sit on the meta
device and accelerate's hooks bring them in for each forward), which exercises the hooks; layers on
two different GPUs have not been tried.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model
from click.testing import CliRunner
from conftest import make_model

from selfextend.cli.main import main
from selfextend.core.rope import RotationTable, rotate
from selfextend.evaluation.nll import shift_nll, token_nll
from selfextend.evaluation.results import read_jsonl
from selfextend.generation.generator import Generator
from selfextend.hf.patch import self_extend
from selfextend.kv.cache import ContextShiftCache

MAP = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "lm_head": "cpu",
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the tiny model in one piece, the same weights dispatched over MAP)."""
    whole = make_model("llama", seed=3)
    split = dispatch_model(
        make_model("llama", seed=3), MAP, main_device="cpu", offload_dir=tmp_path_factory.mktemp("offload")
    )
    assert type(getattr(split.model.layers[1], "_hf_hook", None)).__name__ == "AlignDevicesHook"
    assert split.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    return whole, split


def test_plain_and_self_extend_prefill_match(pair):
    whole, split = pair
    ids = torch.randint(3, 97, (1, 180), generator=torch.Generator().manual_seed(0))
    assert torch.equal(token_nll(split, ids), token_nll(whole, ids))
    with self_extend(whole, 4, 16), self_extend(split, 4, 16):
        want, got = token_nll(whole, ids), token_nll(split, ids)
    assert torch.equal(got, want)


def test_context_shift_with_self_extend_matches(pair):
    whole, split = pair
    ids = torch.randint(3, 97, (1, 200), generator=torch.Generator().manual_seed(1))
    with self_extend(whole, 2, 8), self_extend(split, 2, 8):
        want = shift_nll(whole, ids, n_ctx=48, n_keep=4, chunk=16)
        got = shift_nll(split, ids, n_ctx=48, n_keep=4, chunk=16)
    assert torch.allclose(got, want, atol=1e-5)


def test_generation_through_shifts_matches(pair):
    whole, split = pair
    prompt = list(range(5, 45))
    outs = []
    for model in (whole, split):
        with self_extend(model, 2, 8):
            gen = Generator(model, ContextShiftCache(model, n_ctx=32, n_keep=2))
            outs.append((list(gen.decode(gen.feed(prompt), 40)), gen.cache.shifts))
    assert outs[0] == outs[1] and outs[0][1] > 0


def test_rotation_table_per_device():
    table = RotationTable()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    x = torch.randn(1, 2, 3, 8)
    assert torch.allclose(table.rotate(x, 5, inv_freq), rotate(x, torch.full((3,), 5), inv_freq), atol=1e-6)
    on_meta = table.rotate(x.to("meta"), 5, inv_freq)  # another device: its own matrix there
    assert on_meta.device.type == "meta" and {k[2].type for k in table.entries} == {"cpu", "meta"}


def test_cli_device_map(tiny_dir, tmp_path):
    runner = CliRunner()
    args = ["ppl", "--model", str(tiny_dir), "--corpus", str(_text(tmp_path)), "--lengths", "64,128"]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert runner.invoke(main, [*args, "-o", str(a)]).exit_code == 0
    r = runner.invoke(main, [*args, "--device-map", "auto", "-o", str(b)])
    assert r.exit_code == 0, r.output
    assert [x["ppl"] for x in read_jsonl(a)] == [x["ppl"] for x in read_jsonl(b)]
    r = runner.invoke(main, [*args, "--device-map", "auto", "--weights", "int8", "-o", str(b)])
    assert r.exit_code == 2 and "--device-map needs float weights" in r.stderr


def test_generate_auto_weights_are_float_with_a_device_map(tiny_dir):
    """generate's default --weights auto means int8 on the CPU, which accelerate cannot place: with a
    device map it means float (it was refused, naming a --weights the user had not given)."""
    args = ["generate", "-m", str(tiny_dir), "-p", "a b c", "-n", "3", "--ctx", "32", "--ignore-eos"]
    r = CliRunner().invoke(main, [*args, "--device-map", "sequential"])
    assert r.exit_code == 0, r.output
    assert "3 tokens" in r.stderr


def test_device_map_names_are_accelerates_and_others_refused(tiny_dir):
    from selfextend.cli.options import DEVICE_MAPS as OFFERED
    from selfextend.models import ModelError, load_model
    from selfextend.models.load import DEVICE_MAPS

    assert OFFERED == DEVICE_MAPS
    with pytest.raises(ModelError, match="unknown device map 'nonsense'"):  # was taken as auto
        load_model(str(tiny_dir), device_map="nonsense")


def _text(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    return path

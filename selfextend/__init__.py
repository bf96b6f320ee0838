"""selfextend: Self-Extend attention and context shift for Hugging Face RoPE language models."""

from selfextend.patch import (
    apply_self_extend,
    max_usable_length,
    remove_self_extend,
    self_extend,
)
from selfextend.positions import max_length

__all__ = [
    "apply_self_extend",
    "max_length",
    "max_usable_length",
    "remove_self_extend",
    "self_extend",
]

"""selfextend: Self-Extend attention and context shift for Hugging Face RoPE language models.

The public functions are imported on first use (PEP 562), so light modules such as
:mod:`selfextend.core.validate` can be imported without torch and transformers (the CLI parses and
refuses its options before anything heavy loads).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from selfextend.core.positions import max_length
    from selfextend.core.validate import ValidationError
    from selfextend.hf.facts import ModelError
    from selfextend.hf.patch import apply_self_extend, max_usable_length, remove_self_extend, self_extend
    from selfextend.models.blocks import TokenIdError

_PUBLIC = {
    "apply_self_extend": "selfextend.hf.patch",
    "max_length": "selfextend.core.positions",
    "max_usable_length": "selfextend.hf.patch",
    "remove_self_extend": "selfextend.hf.patch",
    "self_extend": "selfextend.hf.patch",
    "ValidationError": "selfextend.core.validate",
    "ModelError": "selfextend.hf.facts",
    "TokenIdError": "selfextend.models.blocks",
}

__all__ = [
    "ModelError",
    "TokenIdError",
    "ValidationError",
    "apply_self_extend",
    "max_length",
    "max_usable_length",
    "remove_self_extend",
    "self_extend",
]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'selfextend' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})

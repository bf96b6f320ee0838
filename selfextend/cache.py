"""A fixed-size KV cache that shifts its context instead of growing: generation runs forever.

As llama.cpp does when ``n_past + n_new > n_ctx``: keep the first ``n_keep`` cells (the system
prompt), discard the older half of the rest, ``n_discard = (n_past - n_keep) // 2``, move the
newer half down by ``n_discard`` and re-rotate its keys by ``-n_discard`` (K-shift: keys are
cached after RoPE, and rotations compose). Values are not rotated. Positions stay contiguous,
so after a shift the next token is exactly what a fresh forward over the kept tokens at their
compacted positions would give, and Self-Extend's grouped positions follow the shifted ones.

The storage is allocated once per layer at construction and never reallocated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from selfextend.rope import layer_frequencies, rotate
from selfextend.validate import check_int


def discard_count(n_past: int, n_keep: int) -> int:
    """Cells one context shift drops: the older half of what is not kept (llama.cpp's rule)."""
    return (n_past - n_keep) // 2


DiscardPolicy = Callable[[int, int, int], int]
"""``(n_past, n_keep, n_need) -> n_discard``: how many cells after the kept ones the next shift drops,
given that at least ``n_need`` must go for the pending write to fit (fewer means another shift follows).
The cache shifts by exactly the returned count right after the call."""


class ContextShiftLayer(CacheLayerMixin):
    """One layer's keys and values in preallocated (B, Hkv, n_ctx, D) buffers, filled up to ``n_past``."""

    is_sliding = False
    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.n_past = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the buffers exist from the start."""

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, Hkv, n, D) states and return views of all cached states; never truncates."""
        if key_states.device != self.device:  # a layer placed on another device by a device map
            self._move(key_states.device)
        n = key_states.shape[-2]
        end = self.n_past + n
        if end > self.capacity:
            raise RuntimeError(
                f"KV cache overflow: {self.n_past} cached + {n} new > {self.capacity}; call make_room() first"
            )
        self.keys[..., self.n_past : end, :] = key_states
        self.values[..., self.n_past : end, :] = value_states
        self.n_past = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def _move(self, device: torch.device) -> None:
        """Put the buffers on ``device``, keeping what is cached (fresh buffers when empty: the first
        allocation may sit on the meta device of an offloaded model)."""
        if self.n_past == 0:
            self.keys = torch.zeros_like(self.keys, device=device)
            self.values = torch.zeros_like(self.values, device=device)
        else:
            self.keys, self.values = self.keys.to(device), self.values.to(device)
        self.device = device

    def shift(self, n_keep: int, n_discard: int, inv_freq: torch.Tensor) -> None:
        """Drop cells [n_keep, n_keep + n_discard) and move the rest down, keys re-rotated by -n_discard."""
        src, dst = slice(n_keep + n_discard, self.n_past), slice(n_keep, self.n_past - n_discard)
        moved = self.n_past - n_keep - n_discard
        delta = torch.full((moved,), -n_discard, device=self.device)
        self.keys[..., dst, :] = rotate(self.keys[..., src, :], delta, inv_freq)
        self.values[..., dst, :] = self.values[..., src, :].clone()
        self.n_past -= n_discard

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n_past + query_length, 0

    def get_seq_length(self) -> int:
        return self.n_past

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.n_past = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` cells (transformers' convention: a negative count)."""
        self.n_past = max(0, self.n_past + min(tokens_to_remove, 0))


class ContextShiftCache(Cache):
    """A transformers ``Cache`` of fixed capacity ``n_ctx`` that keeps ``n_keep`` tokens and shifts the rest.

    Call :meth:`make_room` before each forward with the number of tokens about to be written;
    it shifts as often as needed and returns how many shifts it made. Positions for the next
    tokens are ``get_seq_length()`` onwards, which transformers uses by default.
    """

    def __init__(
        self,
        model: nn.Module,
        n_ctx: int,
        n_keep: int = 0,
        batch_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        n_ctx = check_int(n_ctx, "context size", 2)
        n_keep = check_int(n_keep, "n_keep (tokens kept at every shift)", 0, n_ctx - 2)
        batch_size = check_int(batch_size, "batch size", 1)
        config = model.config.get_text_config()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        param = next(model.parameters())
        dtype, device = dtype or param.dtype, device or param.device
        shape = (batch_size, kv_heads, n_ctx, head_dim)
        layers = [
            ContextShiftLayer(
                torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
            )
            for _ in range(config.num_hidden_layers)
        ]
        super().__init__(layers=layers)
        self.frequencies = layer_frequencies(model)  # each layer's own (Gemma 3: local and global bases)
        self.n_ctx, self.n_keep = n_ctx, n_keep
        self.shifts = 0
        self.discarded = 0
        self.discard_policy: DiscardPolicy | None = None  # None: discard_count (llama.cpp's half)

    @property
    def n_past(self) -> int:
        return self.layers[0].n_past

    def free(self) -> int:
        """Cells left before the next shift."""
        return self.n_ctx - self.n_past

    def max_chunk(self) -> int:
        """The largest write that one shift can always make room for (half of the shiftable part)."""
        return max(1, (self.n_ctx - self.n_keep) // 2)

    def truncate(self, n_past: int) -> None:
        """Forget every cell from ``n_past`` on (no shift, no rotation)."""
        for layer in self.layers:
            layer.n_past = min(layer.n_past, n_past)

    def load_prefix(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Fill an empty cache with per-layer (B, Hkv, n, D) states (from a prompt-cache file)."""
        if len(keys) != len(self.layers):
            raise ValueError(f"{len(keys)} layers of states for a cache of {len(self.layers)} layers")
        for layer, k, v in zip(self.layers, keys, values, strict=True):
            layer.reset()
            layer.update(k.to(layer.device, layer.dtype), v.to(layer.device, layer.dtype))

    def make_room(self, n_new: int) -> int:
        """Shift until ``n_new`` more tokens fit; returns the number of shifts made."""
        if n_new > self.n_ctx - self.n_keep - 1:
            raise ValueError(
                f"cannot write {n_new} tokens at once into a cache of {self.n_ctx} keeping {self.n_keep}; "
                f"feed at most {self.max_chunk()} at a time"
            )
        made = 0
        while self.n_past + n_new > self.n_ctx:
            if self.discard_policy is None:
                n_discard = discard_count(self.n_past, self.n_keep)
            else:
                n_discard = self.discard_policy(self.n_past, self.n_keep, self.n_past + n_new - self.n_ctx)
            self.shift(n_discard)
            made += 1
        return made

    def shift(self, n_discard: int) -> None:
        """One context shift: drop cells ``[n_keep, n_keep + n_discard)``, move the rest down and re-rotate
        their keys by ``-n_discard``."""
        if not 1 <= n_discard <= self.n_past - self.n_keep:
            raise ValueError(
                f"cannot discard {n_discard} cells: {self.n_past} cached, {self.n_keep} kept"
                if n_discard
                else f"nothing left to discard: {self.n_past} cached, {self.n_keep} kept"
            )
        for layer, freq in zip(self.layers, self.frequencies, strict=True):
            layer.shift(self.n_keep, n_discard, freq.inv_freq)
        self.shifts += 1
        self.discarded += n_discard

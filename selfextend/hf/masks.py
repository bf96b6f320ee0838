"""What the ``selfextend`` attention reads of what transformers hands it: the padding of a 2D mask (the
mask function builds no (Lq, Lk) mask: causality and the neighbor/grouped split come from positions), the
queries' positions, and a static cache's written slots."""

from __future__ import annotations

from typing import Any

import torch
from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

from selfextend.core.cells import read_once
from selfextend.core.validate import ValidationError


def padding_mask(
    batch_size: int,
    kv_length: int,
    kv_offset: int = 0,
    mask_function: Any = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask function for ``selfextend``: only the (B, Lk) key padding, or None when there is none.

    Causality and the neighbor/grouped split are computed inside the attention function from
    key positions, so no (Lq, Lk) mask is ever built. Any other mask (the sliding-window mask of
    hybrid models' sliding layers, which keep their own attention) is SDPA's usual one.
    """
    if mask_function is not causal_mask_function:
        plain_sliding = kwargs.get("local_size") is not None and not kwargs.get("use_vmap")
        prefill = kwargs.get("q_length", 2) > 1  # a decode step's mask is one row: transformers' own
        if plain_sliding and prefill and (attention_mask is None or bool(attention_mask.all())):
            return None  # the sliding layer's band is cut from slot arithmetic (sliding_window_attention)
        return sdpa_mask(
            batch_size=batch_size,
            kv_length=kv_length,
            kv_offset=kv_offset,
            mask_function=mask_function,
            attention_mask=attention_mask,
            **kwargs,
        )
    if attention_mask is None:
        return None
    mask = prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset : kv_offset + kv_length]
    return None if bool(mask.all()) else mask


def split_padding(attention_mask: torch.Tensor | None, kv_length: int) -> torch.Tensor | None:
    """Per-row count of left-padding slots, or None without padding or where it only trails the tokens
    (right padding: no token sees a slot after it, so the real tokens' outputs are as alone; a decode
    step after it has a gap, refused). ValidationError for other shapes."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValidationError(
            "attention_mask", "must be a 2D padding mask for selfextend, not a prepared 4D mask"
        )
    mask = attention_mask[:, -kv_length:].bool()
    if bool(mask.all()) or not bool((mask[:, 1:] > mask[:, :-1]).any()):
        return None
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValidationError(
            "attention_mask", "must pad before the tokens (left) or after them (right), not between them"
        )
    return (~mask).sum(dim=-1)


def query_positions(
    kwargs: dict[str, Any], batch: int, q_len: int, kv_len: int, device: torch.device
) -> torch.Tensor:
    """(B, Lq) positions of the queries: the model's position_ids, else the cache slots."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(kv_len - q_len, kv_len, device=device)[None]
    return position_ids.expand(batch, -1)


def written(key: torch.Tensor, value: torch.Tensor, q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value slots up to the last query's position: a static cache (transformers' ``StaticCache``)
    hands every slot of its length, a slot's index its position, those past the queries not yet written
    (zeros); read as gapless keys ending at the last query they gave wrong logits."""
    last = read_once(q_pos, "written", lambda: int(q_pos[:, -1].max()) + 1)  # (once a forward, not a layer)
    if key.shape[2] <= last:
        return key, value
    return key[:, :, :last], value[:, :, :last]

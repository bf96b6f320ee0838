"""A draft model's output layer over part of the vocabulary: the first ``n`` token ids and the context's.

Why: a draft need not be exact (the target's check keeps the output plain decoding's, greedy bit for bit,
sampled from the same distribution), and in a model with a large vocabulary the output layer is most of
a draft's step: Gemma 3's 262,144 rows are 60% of its Q4_K_M step on a CPU, so its drafts cost 0.6 of a
target step and speculative decoding gained ~1.1x. Scoring a subset is FR-Spec's idea (Zhao et al. 2025,
frequency-ranked subsets); BPE vocabularies list their merges roughly by frequency, so the first ids are a
ready-made ranking, and the ids the context holds are scored too (names and code identifiers a reply
repeats), their rows gathered as they appear. Every other id gets -inf: the draft never proposes it, and
where the target picks one the check takes it as its own token (the pass's last).

Ours because no library offers it for our cells and GGUF block heads; the products are the head's own
(:func:`~selfextend.generation.products.product_of` over a view of its first rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from selfextend.core.validate import check_int
from selfextend.generation.products import product_of
from selfextend.models.blocks import BlockLinear
from selfextend.native.quant import quant_kernels

HELD_MOST = 8192  # extra rows held at most: past it, only the current context's are kept


class PartialHead:
    """``head(x) -> logits``: x (M, hidden) -> (M, vocab), the ids ``[0, n)`` and those :meth:`hold` was
    given scored by ``head``'s rows, every other one -inf. ``n`` is rounded up to a multiple of 8 (the
    kernels' interleaved groups) and at most the vocabulary. ``head``: a GGUF block layer or an
    ``nn.Linear`` (ValueError for others: quantized int8/int4 heads are not sliced)."""

    def __init__(self, head: nn.Module, n: int) -> None:
        n = check_int(n, "draft vocabulary", 1)
        self.vocab = head.out_features
        self.n = min(self.vocab, -(-n // 8) * 8)
        if isinstance(head, BlockLinear):
            first: nn.Module = BlockLinear(head.blocks[: self.n], head.kind, head.in_features)
            kernels = quant_kernels()
            if kernels is None:
                raise ValueError("a draft vocabulary over GGUF blocks needs the native kernels (not built)")
            self._rows = lambda ids: kernels.rows(head.blocks, head.kind, head.in_features, ids)
        elif type(head) is nn.Linear and head.bias is None:
            first = nn.Linear(head.in_features, self.n, bias=False, device="meta")
            first.weight = nn.Parameter(head.weight[: self.n], requires_grad=False)  # a view: no copy
            self._rows = lambda ids: head.weight[ids].float()
        else:
            raise ValueError(
                f"a draft vocabulary needs a GGUF block or float output layer, not {type(head).__name__}"
            )
        self._first = product_of((first,), logits=True)
        self.device = head.weight.device if isinstance(head, nn.Linear) else head.blocks.device
        self.ids = torch.empty(0, dtype=torch.long, device=self.device)  # (E,) the extra ids, sorted
        self.rows = torch.empty(0, head.in_features, device=self.device)  # (E, hidden) float32
        self._held: set[int] = set()

    def hold(self, context: Sequence[int]) -> None:
        """Score the ids of ``context`` from now on too (those not among the first ``n``); past
        :data:`HELD_MOST` extra rows, only this context's are kept."""
        ids = {int(t) for t in context if self.n <= t < self.vocab}
        if ids <= self._held:
            return
        self._held = ids if len(self._held | ids) > HELD_MOST else self._held | ids
        self.ids = torch.tensor(sorted(self._held), dtype=torch.long, device=self.device)
        self.rows = self._rows(self.ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._first(x)  # (M, n)
        if self.n == self.vocab:
            return y
        out = y.new_full((x.shape[0], self.vocab), float("-inf"))
        out[:, : self.n] = y
        if len(self.ids):
            out[:, self.ids] = (x.float() @ self.rows.T).to(y.dtype)  # (M, E)
        return out

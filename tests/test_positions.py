"""Self-Extend's positions against values worked out by hand from the paper's formula, and the attention
kernels against an oracle that knows nothing but a hand-written table of relative distances.

The paper (Jin et al. 2024, with FLOOR grouping): for a query at ``i`` and a key at ``j``, ``i - j < W`` uses
the normal positions; otherwise the key sits at ``j // G`` and the query at ``i // G + W - W // G``.
Every number below was computed by hand, not by the code under test.
"""

from __future__ import annotations

import pytest
import torch

from selfextend.core.attention import self_extend_attention, self_extend_attention_reference
from selfextend.core.positions import grouped_key_positions, grouped_query_positions, max_length
from selfextend.core.rope import rotate


@pytest.mark.parametrize(
    "i, group_size, window, expected",
    [
        (20, 3, 7, 11),  # 20 // 3 + 7 - 7 // 3 = 6 + 7 - 2; W % G != 0
        (7, 2, 7, 7),  # 3 + 7 - 3: float division (W / G = 3.5) would give 6.5
        (1023, 4, 1024, 1023),  # 255 + 1024 - 256
        (1024, 4, 1024, 1024),  # 256 + 768: the first query past the window
        (100, 1, 10, 100),  # G = 1: every position is its own
        (0, 5, 13, 11),  # 0 + 13 - 2
    ],
)
def test_grouped_query_position_by_hand(i, group_size, window, expected):
    assert grouped_query_positions(i, group_size, window) == expected
    assert int(grouped_query_positions(torch.tensor(i), group_size, window)) == expected


@pytest.mark.parametrize(
    "j, group_size, expected", [(13, 3, 4), (14, 3, 4), (15, 3, 5), (0, 4, 0), (7, 2, 3)]
)
def test_grouped_key_position_by_hand(j, group_size, expected):
    assert grouped_key_positions(j, group_size) == expected


def test_max_length_by_hand():
    assert max_length(8192, 4, 1024) == 29696  # (8192 - 1024) * 4 + 1024
    assert max_length(4096, 16, 1024) == 50176
    assert max_length(8192, 6, 1024) == 44028  # the paper's 44,032: its last query was at distance 8192


@pytest.mark.parametrize(
    "trained, group_size, window", [(8192, 6, 1024), (64, 3, 16), (64, 4, 16), (50, 7, 3)]
)
def test_max_length_is_the_last_length_inside_the_trained_window(trained, group_size, window):
    """The last query of max_length tokens attends key 0 at most L - 1 away; one more token is L away."""
    n = max_length(trained, group_size, window)
    assert (
        grouped_query_positions(n - 1, group_size, window) - grouped_key_positions(0, group_size)
        <= trained - 1
    )
    assert grouped_query_positions(n, group_size, window) - grouped_key_positions(0, group_size) >= trained


# Relative distance (query position minus key position) that each (i, j) pair attends at, G = 2, W = 3,
# written out by hand: |i - j| < 3 keeps i - j; otherwise (i // 2 + 2) - j // 2. Row i, columns j <= i.
DISTANCES_G2_W3 = [
    [0],
    [1, 0],
    [2, 1, 0],
    [3, 2, 1, 0],  # (3, 0): 1 + 2 - 0 = 3 is grouped (distance 3 = W: the boundary belongs to the groups)
    [4, 4, 2, 1, 0],
    [4, 4, 3, 2, 1, 0],  # (5, 2): 2 + 2 - 1 = 3
    [5, 5, 4, 4, 2, 1, 0],
    [5, 5, 4, 4, 3, 2, 1, 0],
]


def _oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Attention whose score for (i, j) is q_i . R(d_ij) k_j with d_ij from the table: RoPE scores depend only
    on the distance, so rotating the query by d_ij and leaving the key alone gives the same score. Plain
    rotate-half RoPE written here, independently of the package."""
    d = q.shape[-1]
    out = torch.empty_like(q)
    for i, row in enumerate(DISTANCES_G2_W3):
        dist = torch.tensor(row, dtype=torch.float64)  # (i + 1,)
        angle = dist[:, None] * inv_freq.double()[None, :]  # (i + 1, D/2)
        cos, sin = torch.cat((angle.cos(), angle.cos()), -1), torch.cat((angle.sin(), angle.sin()), -1)
        qi = q[..., i : i + 1, :].double()  # (B, H, 1, D)
        half = torch.cat((-qi[..., d // 2 :], qi[..., : d // 2]), -1)
        q_rot = qi * cos + half * sin  # (B, H, i + 1, D): the query rotated by each distance
        scores = (q_rot * k[..., : i + 1, :].double()).sum(-1) / d**0.5  # (B, H, i + 1)
        out[..., i, :] = (scores.softmax(-1)[..., None] * v[..., : i + 1, :].double()).sum(-2).to(q.dtype)
    return out


def test_kernels_equal_the_hand_written_distance_table():
    torch.manual_seed(0)
    b, h, n, d = 1, 2, len(DISTANCES_G2_W3), 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    q, k, v = torch.randn(b, h, n, d), torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    pos = torch.arange(n)[None]  # (1, n)
    expected = _oracle(q, k, v, inv_freq)
    reference = self_extend_attention_reference(q, k, v, pos, pos, 2, 3, inv_freq)
    efficient = self_extend_attention(
        rotate(q, pos, inv_freq), rotate(k, pos, inv_freq), v, pos, 2, 3, inv_freq
    )
    assert (reference - expected).abs().max() < 1e-5
    assert (efficient - expected).abs().max() < 1e-5
    plain = torch.nn.functional.scaled_dot_product_attention(
        rotate(q, pos, inv_freq), rotate(k, pos, inv_freq), v, is_causal=True
    )
    assert (plain - expected).abs().max() > 1e-3, "the table must differ from plain attention"

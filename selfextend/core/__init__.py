"""Core math: Self-Extend positions, RoPE rotations, attention kernels, argument checks.

No transformers model code: everything here works on tensors and integers.
"""

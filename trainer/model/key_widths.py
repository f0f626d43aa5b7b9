"""The key count dense attention masks are padded to (torch-free: the memory estimate, which
imports no torch, prices the same padded widths as the drafter step)."""

from __future__ import annotations

KEY_MULTIPLE = 16
"""Dense masks carry a multiple of this many keys (padding keys masked off): CPU SDPA costs
~20 % more per score element at other key counts (1,159 us for 111 keys vs 842 us for 112,
forward and backward, tiny drafter widths); the drafter pads K/V with zeros to match."""

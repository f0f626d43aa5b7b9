"""The analytic flex BlockMask against create_block_mask, the dense mask and SDPA.

`flex_dflash_block_mask` computes the tile structure from the anchors; these tests hold it to
`reference_flex_block_mask` (create_block_mask over the same mask_mod) tile for tile, to the
dense SDPA mask element for element (a full tile = visible everywhere, a partial tile = its
mask_mod, any other tile = nothing: what the flex kernels compute), and flex attention's
output through it to SDPA's. Small tiles make several tiles per row at small shapes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from trainer.kernels.peak_memory import cpu_peak_bytes
from trainer.memory.costs import Piece, flex_block_mask_bytes
from trainer.model.attention import attend
from trainer.model.masks import (
    dense_dflash_mask,
    dflash_tiles,
    flex_dflash_block_mask,
    reference_flex_block_mask,
)

TILES = st.sampled_from([1, 2, 4, 8, 16, 128])


def full_tiles(bm: BlockMask) -> Tensor:
    """The full (mask_mod-free) tiles of a BlockMask as a dense [B, H, nQ, nKV] int tensor."""
    assert bm.full_kv_num_blocks is not None and bm.full_kv_indices is not None
    return BlockMask.from_kv_blocks(bm.full_kv_num_blocks, bm.full_kv_indices).to_dense()


def effective_mask(bm: BlockMask, rows: int) -> Tensor:
    """Element [B, Q, KV] visibility as the kernels see it: full tiles, or partial ∧ mask_mod."""
    q_len, kv_len = bm.seq_lengths
    tq, tk = bm.BLOCK_SIZE
    b, q, kv = torch.meshgrid(
        torch.arange(rows), torch.arange(q_len), torch.arange(kv_len), indexing="ij"
    )
    full = full_tiles(bm)[:, 0].bool()
    partial = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices).to_dense()[:, 0].bool()
    n_q, n_kv = full.shape[1], full.shape[2]
    assert partial.shape[1:] == (n_q, n_kv)
    tile_q, tile_kv = q // tq, kv // tk
    in_full = full[b, tile_q, tile_kv]
    in_partial = partial[b, tile_q, tile_kv]
    assert not (in_full & in_partial).any(), "a tile is listed both full and partial"
    return in_full | (in_partial & bm.mask_mod(b, torch.zeros_like(b), q, kv))


@st.composite
def mask_inputs(draw: st.DrawFn) -> tuple[Tensor, Tensor, int, Tensor | None]:
    """Rows of sorted anchors (padding anchors 0 at the end), a ragged valid mask, and maybe
    per-block document starts <= the anchor (as packing produces)."""
    rows = draw(st.integers(1, 3))
    seq = draw(st.integers(1, 40))
    n = draw(st.integers(1, 6))
    block = draw(st.integers(1, 6))
    anchors, starts, valid = [], [], []
    for _ in range(rows):
        kept = draw(st.integers(0, n))
        row = sorted(draw(st.integers(0, seq - 1)) for _ in range(kept)) + [0] * (n - kept)
        anchors.append(row)
        starts.append([draw(st.integers(0, a)) for a in row])
        length = draw(st.integers(1, seq))
        holes = draw(st.lists(st.integers(0, seq - 1), max_size=3))
        valid.append([j < length and j not in holes for j in range(seq)])
    start = torch.tensor(starts) if draw(st.booleans()) else None
    return torch.tensor(anchors), torch.tensor(valid), block, start


@settings(max_examples=60, deadline=None)
@given(inputs=mask_inputs(), tq=TILES, tk=TILES)
def test_analytic_tiles_equal_create_block_mask(
    inputs: tuple[Tensor, Tensor, int, Tensor | None], tq: int, tk: int
) -> None:
    """Same partial and full tiles (and so the same backward q-tiles) as create_block_mask."""
    anchors, valid, block, start = inputs
    got = flex_dflash_block_mask(anchors, valid, block, start, (tq, tk))
    want = reference_flex_block_mask(anchors, valid, block, start, (tq, tk))
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    assert torch.equal(got.to_dense(), want.to_dense())
    assert torch.equal(full_tiles(got), full_tiles(want))
    assert torch.equal(got.kv_num_blocks, want.kv_num_blocks)
    assert got.full_kv_num_blocks is not None and want.full_kv_num_blocks is not None
    assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)
    for g, w in (
        (got.q_num_blocks, want.q_num_blocks),
        (got.full_q_num_blocks, want.full_q_num_blocks),
    ):
        assert g is not None and w is not None and torch.equal(g, w)


@settings(max_examples=60, deadline=None)
@given(inputs=mask_inputs(), tq=TILES, tk=TILES)
def test_analytic_block_mask_is_the_dense_mask_elementwise(
    inputs: tuple[Tensor, Tensor, int, Tensor | None], tq: int, tk: int
) -> None:
    """Full tiles are visible everywhere, skipped tiles nowhere: the kernels' view is exact."""
    anchors, valid, block, start = inputs
    got = flex_dflash_block_mask(anchors, valid, block, start, (tq, tk))
    dense = dense_dflash_mask(anchors, valid, block, start)[:, 0]
    assert torch.equal(effective_mask(got, anchors.shape[0]), dense)


def test_tiles_are_disjoint_and_cover_the_diagonal() -> None:
    """Every Q tile lists its own block keys; full and partial never overlap."""
    anchors = torch.tensor([[5, 9, 200, 300]])
    valid = torch.ones(1, 320, dtype=torch.bool)
    partial, full = dflash_tiles(anchors, valid, 16, None, (16, 16))
    assert not (partial & full).any()
    # Q tile 2 = block 2 (anchor 200): context tiles [0, 192) lie inside [0, 200): full;
    # [192, 208) is cut by the anchor: partial; its own keys are exactly KV tile 22: full.
    assert full[0, 2, :12].all() and partial[0, 2, 12] and not full[0, 2, 12:22].any()
    assert full[0, 2, 22] and not (partial | full)[0, 2, 13:22].any()
    for m in range(4):
        assert full[0, m, 20 + m]  # block keys start at S = 320 = KV tile 20
    # With 32-wide KV tiles a block fills half a tile: partial, never full.
    partial, full = dflash_tiles(anchors, valid, 16, None, (16, 32))
    assert partial[0, :, 10:].sum().item() == 4 and not full[0, :, 10:].any()


def sdpa_vs_flex_inputs(
    seed: int, heads: int, kv_heads: int
) -> tuple[Tensor, Tensor, int, Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows, seq, n, block = 2, 150, 5, 8
    anchors = torch.randint(1, seq, (rows, n), generator=g).sort(1).values
    anchors[1, -1] = 0  # a padding block
    start = (torch.rand(rows, n, generator=g) * anchors).long()
    valid = torch.ones(rows, seq, dtype=torch.bool)
    valid[1, 120:] = False
    kv_len = seq + n * block
    q = torch.randn(rows, heads, n * block, 16, generator=g)
    k = torch.randn(rows, kv_heads, kv_len, 16, generator=g)
    v = torch.randn(rows, kv_heads, kv_len, 16, generator=g)
    return anchors, valid, block, start, q, k, v


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flex_through_analytic_mask_equals_sdpa(kv_heads: int) -> None:
    """Eager flex (the CPU reference path, mask_mod-driven; CPU flex has no backward) equals
    SDPA through the analytic BlockMask, with and without GQA."""
    anchors, valid, block, start, q, k, v = sdpa_vs_flex_inputs(1, 4, kv_heads)
    bm = flex_dflash_block_mask(anchors, valid, block, start, (16, 32))
    dense = dense_dflash_mask(anchors, valid, block, start)
    gqa = kv_heads != 4
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        out = flex_attention(q, k, v, block_mask=bm, scale=0.25, enable_gqa=gqa)
    assert isinstance(out, Tensor)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.25, enable_gqa=gqa)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_cpu_flex_uses_the_tiles_and_equals_sdpa() -> None:
    """Compiled flex on CPU skips tiles by the BlockMask (dropping its full tiles changes the
    output), and through the analytic mask it equals SDPA: the tile structure is exercised by
    a real kernel, not only by the mask_mod."""
    anchors, valid, block, start, q, k, v = sdpa_vs_flex_inputs(2, 4, 2)
    start[0] = 0  # row 0 unpacked: long context prefixes, so there are full tiles
    bm = flex_dflash_block_mask(anchors, valid, block, start, (16, 16))
    assert bm.full_kv_num_blocks is not None and int(bm.full_kv_num_blocks.sum()) > 0
    dense = dense_dflash_mask(anchors, valid, block, start)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.25, enable_gqa=True)
    compiled = torch.compile(flex_attention, dynamic=False)
    out = compiled(q, k, v, block_mask=bm, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert bm.full_kv_indices is not None
    no_full = BlockMask.from_kv_blocks(
        bm.kv_num_blocks,
        bm.kv_indices,
        torch.zeros_like(bm.full_kv_num_blocks),
        bm.full_kv_indices,
        BLOCK_SIZE=bm.BLOCK_SIZE,
        mask_mod=bm.mask_mod,
        seq_lengths=bm.seq_lengths,
    )
    wrong = compiled(q, k, v, block_mask=no_full, scale=0.25, enable_gqa=True)
    assert (wrong - ref).abs().max() > 1e-2


@pytest.mark.parametrize("masked", [True, False])
def test_cuda_sdpa_path_repeats_kv_and_equals_enable_gqa(masked: bool) -> None:
    """attend's CUDA choice (forced on CPU): a dense mask with GQA repeats K/V to the query
    heads instead of enable_gqa; outputs and grads equal the enable_gqa path."""
    anchors, valid, block, start, q, k, v = sdpa_vs_flex_inputs(3, 8, 2)
    mask = dense_dflash_mask(anchors, valid, block, start) if masked else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves_ref = [t.clone().requires_grad_() for t in (q, k, v)]
    qa, ka, va = leaves
    qr, kr, vr = leaves_ref
    out = attend(qa, ka, va, mask, scale=0.25, device_type="cuda")
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(ref)
    torch.autograd.backward([(out * w).sum(), (ref * w).sum()])
    for a, b in zip(leaves, leaves_ref, strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_analytic_build_never_materialises_q_by_kv() -> None:
    """At a seed-like width (512 anchors x block 16 over 2048 context) the build's peak is a
    small fraction of one dense bool [R, Q, KV] mask; create_block_mask's is several masks."""
    rows, seq, n, block = 2, 2048, 512, 16
    g = torch.Generator().manual_seed(0)
    anchors = torch.randperm(seq - 1, generator=g)[:n].sort().values.expand(rows, n).contiguous()
    valid = torch.ones(rows, seq, dtype=torch.bool)
    start = torch.zeros_like(anchors)
    dense_bytes = rows * n * block * (seq + n * block)  # 1 byte per bool element
    analytic = cpu_peak_bytes(lambda: flex_dflash_block_mask(anchors, valid, block, start))
    assert analytic < dense_bytes / 20, (analytic, dense_bytes)


def test_memory_estimate_counts_the_block_masks_bytes() -> None:
    """costs.flex_block_mask_bytes = the BlockMask's tile tensors (partial and full, kv and q
    sides) + the anchors, starts and valid mask its mask_mod reads."""
    for rows, seq, n, block in [(3, 768, 512, 16), (2, 100, 7, 4), (1, 8192, 512, 16)]:
        g = torch.Generator().manual_seed(seq)
        anchors = torch.randint(0, seq, (rows, n), generator=g).sort(1).values
        valid = torch.ones(rows, seq, dtype=torch.bool)
        bm = flex_dflash_block_mask(anchors, valid, block, torch.zeros_like(anchors))
        tensors = [
            bm.kv_num_blocks,
            bm.kv_indices,
            bm.full_kv_num_blocks,
            bm.full_kv_indices,
            bm.q_num_blocks,
            bm.q_indices,
            bm.full_q_num_blocks,
            bm.full_q_indices,
        ]
        tile_bytes = sum(t.nbytes for t in tensors if t is not None)
        captured = anchors.nbytes * 2 + valid.nbytes
        assert flex_block_mask_bytes(Piece(rows, seq, n), block) == tile_bytes + captured

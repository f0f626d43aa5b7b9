"""Target attention for packed rows on CPU: each document as a row of its own, in length groups.

Transformers' packed-sequence path (no 2D mask, `position_ids` restarting per document) builds a
block-diagonal [T, T] mask per row, and CPU SDPA with a mask computes every row x row score:
attention per token grows with the row length, and the mask costs a `where` per capture. Here
the projections, norms, RoPE and MLPs stay on the packed rows (no padding), and only the
attention lays the micro-batch's documents out as right-padded rows of their own, in groups of
similar length (a cost model picks them, `_split`), each as wide as its longest document
rounded up to `WIDTH_MULTIPLE`, and runs SDPA with `is_causal=True` and no mask per group.
Right padding is harmless there: no real query sees a later (pad) key. The outputs are gathered
back to the packed layout.

The layout (gather and scatter indices, groups) is computed once per capture from the
position ids (`document_layout`) and reaches every layer's attention call as the keyword
`LAYOUT_KWARG`, which transformers forwards from the decoder's `**kwargs` to the registered
attention function (`ATTENTION_NAME`, in `AttentionInterface`; 4.56 and 5.x).

Measured on the tiny CPU config (`benchmarks/bench_packed.py --capture-only`, one thread):
capture 0.86-0.88x sorted's tokens per CPU-second through the mask, 0.94-0.98x here; one group
0.62x, two 0.84x, three 0.91x, four 0.95x: most of the gain is from many groups and the
16-multiple widths, not from skipping the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "dflash_documents"
"""The name `config._attn_implementation` is set to for the duration of a packed capture."""

LAYOUT_KWARG = "dflash_document_layout"
"""The decoder keyword that carries the `DocumentLayout` to every attention call (the name of
`document_attention_forward`'s parameter)."""

WIDTH_MULTIPLE = 16
"""Group widths are padded up to a multiple of this (from half of it on; shorter ones stay). CPU
SDPA (the flash kernel, fp32, AVX-512) handles a key length that is not a multiple of 16 at up
to twice the cost of the next multiple: measured per row of 4 heads of 16 dims, 47 keys 29 us,
48 keys 15 us, 63 keys 41 us, 64 keys 24 us; right padding is free to add."""

ROW_KEY_COST = 80
"""Per query, the cost of attention that does not grow with the keys, in keys: the measured
CPU cost of a causal row of width W (multiple of 16) fits W * (W + 80) (tiny CPU config: 0.0027
us per unit for 4 heads of 16 dims, from 16 to 160 keys)."""

GROUP_COST = 4_000
"""The fixed cost of one more group (an SDPA call and its views, ~10 us) in the same units;
2,000 to 9,000 measure alike on the tiny config."""

DEFAULT_MAX_GROUPS = 8
"""More groups than the cost model picks on the tiny config's packed micro-batches (5 to 8)."""


@dataclass(frozen=True)
class DocumentGroup:
    """`rows` documents, each right-padded to `width` slots."""

    rows: int
    width: int


@dataclass(frozen=True)
class DocumentLayout:
    """Where each packed position's document sits in the grouped rows.

    `gather` [S] is the packed position (flattened [B * T]) every slot reads, the groups' rows
    laid end to end (group 0's rows * width slots, then group 1's, ...); a pad slot repeats its
    document's last position (never seen by a real query: causal, and it comes after it).
    `scatter` [B * T] is each packed position's slot, so gather[scatter] == arange(B * T).
    """

    groups: tuple[DocumentGroup, ...]
    gather: Tensor
    scatter: Tensor
    batch: int
    length: int

    @property
    def padded_positions(self) -> int:
        return int(self.gather.shape[0])


def _row_cost(width: int) -> int:
    return width * (width + ROW_KEY_COST)


def _split(widths: list[int], max_groups: int, group_cost: float) -> list[tuple[int, int]]:
    """Groups [lo, hi) of `widths` (padded, non-increasing) minimising the modelled cost
    sum_g n_g * W_g * (W_g + ROW_KEY_COST) + group_cost per group, W_g = widths[lo]: the exact
    optimum over cuts between distinct widths (a DP over the run-length classes), then, while
    there are more than `max_groups`, the adjacent pair whose merge costs least is merged."""
    n = len(widths)
    bounds = [i for i in range(n) if i == 0 or widths[i] != widths[i - 1]] + [n]
    m = len(bounds) - 1
    best = [0.0] * (m + 1)
    nxt = [m] * (m + 1)
    for a in range(m - 1, -1, -1):
        per = _row_cost(widths[bounds[a]])
        best[a] = float("inf")
        for c in range(a + 1, m + 1):
            v = (bounds[c] - bounds[a]) * per + group_cost + best[c]
            if v < best[a]:
                best[a], nxt[a] = v, c
    spans, a = [], 0
    while a < m:
        spans.append((bounds[a], bounds[nxt[a]]))
        a = nxt[a]
    while len(spans) > max_groups:
        # merging g and g+1 pads g+1's rows to g's width and saves one group
        extra = [
            (hi - lo) * (_row_cost(widths[spans[g][0]]) - _row_cost(widths[lo])) - group_cost
            for g, (lo, hi) in enumerate(spans[1:])
        ]
        g = extra.index(min(extra))
        spans[g : g + 2] = [(spans[g][0], spans[g + 1][1])]
    return spans


def document_layout(
    position_ids: Tensor,
    *,
    max_groups: int = DEFAULT_MAX_GROUPS,
    group_cost: float = GROUP_COST,
) -> DocumentLayout:
    """The grouped layout of packed rows: a document starts at each row's first position and
    wherever a position is not its predecessor's + 1 (transformers' own rule,
    `find_packed_sequence_indices`), so a row's padding tail is one more document.

    Documents are sorted by length (longest first, ties in packed order) and cut into groups
    where the modelled attention cost (`_split`) is least, at most `max_groups`; each group is
    as wide as its longest document, padded up (`WIDTH_MULTIPLE`).
    """
    if position_ids.ndim != 2 or position_ids.shape[1] == 0:
        raise ValueError(f"position_ids must be [B, T] with T > 0, got {tuple(position_ids.shape)}")
    if max_groups < 1:
        raise ValueError(f"max_groups must be >= 1, got {max_groups}")
    b, t = position_ids.shape
    flat = position_ids.detach().to("cpu", torch.long).numpy().reshape(-1)
    first = np.empty(b * t, dtype=bool)
    first[1:] = flat[1:] != flat[:-1] + 1
    first[::t] = True
    starts = np.flatnonzero(first)  # packed index of each document's first position
    lengths = np.diff(starts, append=b * t)
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    m = WIDTH_MULTIPLE
    widths = np.where(sorted_lengths < m // 2, sorted_lengths, -(-sorted_lengths // m) * m)
    spans = _split(widths.tolist(), max_groups, group_cost)
    width_of = np.repeat(widths[[lo for lo, _ in spans]], [hi - lo for lo, hi in spans])
    slot_start = np.cumsum(width_of) - width_of  # each document's first slot (sorted order)
    doc_of_slot = np.repeat(np.arange(len(order)), width_of)
    step = np.arange(int(width_of.sum())) - slot_start[doc_of_slot]
    gather_np = starts[order][doc_of_slot] + np.minimum(step, sorted_lengths[doc_of_slot] - 1)
    slot_of_doc = np.empty_like(slot_start)
    slot_of_doc[order] = slot_start
    doc = np.cumsum(first) - 1  # document of each packed position
    scatter_np = slot_of_doc[doc] + (np.arange(b * t) - starts[doc])
    return DocumentLayout(
        groups=tuple(DocumentGroup(rows=hi - lo, width=int(widths[lo])) for lo, hi in spans),
        gather=torch.from_numpy(gather_np),
        scatter=torch.from_numpy(scatter_np),
        batch=b,
        length=t,
    )


def layout_to(layout: DocumentLayout, device: torch.device) -> DocumentLayout:
    """The same layout with its index tensors on `device`."""
    if layout.scatter.device == device:
        return layout
    return replace(layout, gather=layout.gather.to(device), scatter=layout.scatter.to(device))


def document_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    dflash_document_layout: DocumentLayout | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """Block-diagonal causal attention over the packed rows of `dflash_document_layout` (the
    `LAYOUT_KWARG` keyword).

    query [B, H, T, D], key and value [B, Hkv, T, D] (transformers' attention-function
    contract); returns ([B, T, H, D], None). Refuses a mask, a sliding window, dropout or a
    missing layout rather than silently attending otherwise.
    """
    layout = dflash_document_layout
    if layout is None:
        raise ValueError(f"{ATTENTION_NAME} attention needs the {LAYOUT_KWARG} keyword")
    if attention_mask is not None or kwargs.get("sliding_window") is not None or dropout:
        raise ValueError(f"{ATTENTION_NAME} attention takes no mask, sliding window or dropout")
    b, h, t, d = query.shape
    hkv = key.shape[1]
    if (b, t) != (layout.batch, layout.length) or h % hkv:
        raise ValueError(f"{ATTENTION_NAME}: q {tuple(query.shape)} k {tuple(key.shape)} vs layout")
    # [B*T, heads, D] views (free when, as in transformers, the heads were transposed from [B, T]);
    # one gather per tensor for all groups, whose rows are then views of it.
    q = query.transpose(1, 2).reshape(b * t, h, d).index_select(0, layout.gather)
    k = key.transpose(1, 2).reshape(b * t, hkv, d).index_select(0, layout.gather)
    v = value.transpose(1, 2).reshape(b * t, hkv, d).index_select(0, layout.gather)
    outs, at = [], 0
    for g in layout.groups:
        span = slice(at, at + g.rows * g.width)
        at = span.stop
        o = F.scaled_dot_product_attention(
            q[span].view(g.rows, g.width, h, d).transpose(1, 2),
            k[span].view(g.rows, g.width, hkv, d).transpose(1, 2),
            v[span].view(g.rows, g.width, hkv, d).transpose(1, 2),
            is_causal=g.width > 1,
            scale=scaling,
            enable_gqa=hkv != h,
        )
        outs.append(o.transpose(1, 2).reshape(g.rows * g.width, h, d))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.index_select(0, layout.scatter).view(b, t, h, d), None


AttentionInterface.register(ATTENTION_NAME, document_attention_forward)

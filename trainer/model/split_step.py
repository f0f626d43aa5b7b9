"""Memory-bounded drafter steps: one packet, several forward+backward passes, one set of sums.

Activation memory grows with query rows (rows x anchors x block), not with the token budget: at
real widths ~1.3 MB per query row, so the seed's batches need 150-650 GiB in one pass. With a
budget (`model.max_query_rows`), the packet's anchors are drawn once for the whole packet (the
same generator draws as one pass, so runs and resumes do not depend on the budget), then split
into pieces of at most the budget's query rows: whole sequence rows when a row fits, else runs
of anchors inside one row. Each piece runs forward and backward at once, so only one piece's
activations are alive; gradients accumulate in `.grad` and the returned sums are the packet's.

The split is exact: a block's queries see only the context before its anchor and their own
block, so blocks in different pieces never interact, and the objective's results are sums
(normalised once by the pipeline over the whole optimizer step). Only floating-point summation
order differs from the unsplit step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import fields

import torch
from torch import Tensor

from trainer.config import LossConfig
from trainer.kernels.common import Backend
from trainer.model.attention import resolve_backend
from trainer.model.documents import ContextRows, unpack_documents
from trainer.model.drafter import DFlashDrafter
from trainer.model.losses import CE
from trainer.model.masks import Anchors
from trainer.model.objective import StepResult, _noise_like, dflash_objective, draw_anchors

Piece = tuple[slice, slice]
"""(sequence rows, anchor columns) of one micro-step."""


def split_pieces(anchors: Anchors, block_size: int, max_query_rows: int | None) -> list[Piece]:
    """Cover the [rows, anchors] grid with pieces of at most `max_query_rows` query rows.

    Rows are grouped while a group fits; a row that alone exceeds the budget is cut into runs
    of anchors (at least one block per piece, so a budget below the block size means one block
    at a time). None = one piece, the whole packet. Columns that are padding in every row of a
    piece (keep=False) are dropped from it: they contribute nothing.
    """
    rows, width = anchors.positions.shape
    if max_query_rows is not None and max_query_rows < 1:
        raise ValueError(f"max_query_rows must be >= 1 or None, got {max_query_rows}")
    if max_query_rows is None or rows * width * block_size <= max_query_rows:
        return [(slice(0, rows), slice(0, width))]
    keep = anchors.keep
    per_row = keep.sum(1).tolist()  # a row's real anchors come first (padding is at the end)
    pieces: list[Piece] = []
    per_piece = max(1, max_query_rows // block_size)  # anchors per piece when cutting a row
    start = 0
    while start < rows:
        # Grow a group of whole rows while its padded width x block stays within the budget.
        end, group_width = start, 0
        while end < rows:
            w = max(group_width, per_row[end])
            if (end - start + 1) * w * block_size > max_query_rows:
                break
            end, group_width = end + 1, w
        if end > start:
            if group_width > 0:
                pieces.append((slice(start, end), slice(0, group_width)))
            start = end
            continue
        # Row `start` alone is over the budget: runs of `per_piece` anchors.
        for a in range(0, per_row[start], per_piece):
            pieces.append((slice(start, start + 1), slice(a, min(a + per_piece, per_row[start]))))
        start += 1
    return pieces


def bounded_objective_backward(
    drafter: DFlashDrafter,
    input_ids: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor,
    hidden: Tensor,
    *,
    max_query_rows: int | None,
    num_anchors: int,
    gamma: float | None = None,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
    autocast: contextlib.AbstractContextManager[object] | None = None,
    attn_backend: str = "auto",
    ce_backend: Backend = "auto",
    loss_transform: Callable[[Tensor], Tensor] | None = None,
    position_ids: Tensor | None = None,
    unpack: bool | None = None,
    anchors: Anchors | None = None,
    host_masks: tuple[Tensor, Tensor, Tensor | None] | None = None,
    loss: LossConfig = CE,
    teacher: Tensor | None = None,
) -> StepResult:
    """Forward+backward of one packet in pieces of at most `max_query_rows` query rows.

    Gradients accumulate into the drafter's `.grad` (unnormalised `loss_sum`, as one pass
    would); returns the packet's detached sums. `autocast` wraps each forward (not the
    backward). `loss_transform` is applied to each piece's loss before backward (the
    pipeline's non-finite fault hook). The generator draws anchors, then noise, exactly as
    `dflash_objective` does for the whole packet. `position_ids` (packed rows): anchors per
    document, each block inside its own document (see `trainer.model.objective`); the pieces
    cut rows and anchors exactly as for unpacked rows. `unpack` (packed rows; None = when the
    attention backend is SDPA, whose dense mask costs a packed row's every block the whole
    row): after the draws, each document with an anchor becomes a row of its own
    (`trainer.model.documents`), the same computation at less attention work; its context is
    projected on the packed rows (each piece: the rows its documents come from) and gathered. `anchors`:
    drawn by the caller (`masks.sample_anchors` on host copies of the masks, from the same
    generator, so nothing here reads the masks back from the device); None = drawn here.
    `host_masks`: (loss_mask, attention_mask, position_ids) on the host, so each piece's valid
    slots are known there too (`dflash_objective`); not used for unpacked documents.
    `loss`, `teacher`: `dflash_objective`'s (`teacher`: [R, S, H] of the packet's rows; laid
    out with the documents when they are unpacked; never noised). D-PACE's weights are per
    block and a piece holds whole blocks, so the split stays exact.
    """
    ctx = autocast if autocast is not None else contextlib.nullcontext()
    bsz = drafter.config.block_size
    if anchors is None:
        anchors = draw_anchors(loss_mask, attention_mask, num_anchors, generator, position_ids)
    context_rows: ContextRows | None = None
    if anchors.num_blocks == 0:
        pieces: list[Piece] = [(slice(None), slice(None))]
    else:
        if noise > 0:
            hidden = hidden + _noise_like(hidden, noise, generator)
        if unpack is None:
            unpack = resolve_backend(attn_backend, hidden.device) == "sdpa"
        if position_ids is not None and unpack:
            u = unpack_documents(input_ids, loss_mask, attention_mask, position_ids, anchors, bsz)
            input_ids, loss_mask, attention_mask = u.input_ids, u.loss_mask, u.attention_mask
            context_rows = ContextRows(u.index, position_ids, u.groups)
            anchors, position_ids, host_masks = u.anchors, None, None
            teacher = None if teacher is None else u.take(teacher)
        pieces = split_pieces(anchors, bsz, max_query_rows)
    total: StepResult | None = None
    for rows, cols in pieces:
        part = Anchors(anchors.positions[rows, cols], anchors.keep[rows, cols])
        features, piece_rows = hidden[rows], None
        if context_rows is not None:  # the packed rows this piece's documents come from
            packed_rows, piece_rows = context_rows.rows(rows)
            features = hidden[packed_rows]
        with ctx:
            res = dflash_objective(
                drafter,
                None,
                input_ids[rows],
                loss_mask[rows],
                attention_mask[rows],
                features,
                gamma=gamma,
                anchors=part,
                attn_backend=attn_backend,
                ce_backend=ce_backend,
                position_ids=None if position_ids is None else position_ids[rows],
                host_masks=_rows(host_masks, rows),
                context_rows=piece_rows,
                loss=loss,
                teacher=None if teacher is None else teacher[rows],
            )
        piece = res.loss_sum if loss_transform is None else loss_transform(res.loss_sum)
        torch.autograd.backward(piece.float())
        res.loss_sum = piece
        total = _detached(res) if total is None else _add(total, res)
    assert total is not None
    return total


def _rows(
    masks: tuple[Tensor, Tensor, Tensor | None] | None, rows: slice
) -> tuple[Tensor, Tensor, Tensor | None] | None:
    if masks is None:
        return None
    loss, attn, pos = masks
    return loss[rows], attn[rows], None if pos is None else pos[rows]


def _detached(res: StepResult) -> StepResult:
    return StepResult(**{f.name: getattr(res, f.name).detach() for f in fields(res)})


def _add(a: StepResult, b: StepResult) -> StepResult:
    return StepResult(
        **{f.name: getattr(a, f.name) + getattr(b, f.name).detach() for f in fields(a)}
    )

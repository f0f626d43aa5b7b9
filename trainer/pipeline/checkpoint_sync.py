"""What crosses nodes that share no storage: the checkpoint a run resumes from, and who failed.

Resume: global rank 0 alone picks and loads a checkpoint from its own run dir; every other rank
receives it through torch.distributed, so no other node needs a copy (a copy it has is
ignored: rank 0 is the truth). First a small pickled header goes out with
`broadcast_object_list`: rank 0's decision (a checkpoint, none, or the one-line refusal) and
the state's skeleton, every tensor replaced by a `Slot` naming its dtype and shape. Then the
tensors go as raw bytes: small ones packed into buckets of at most `BUCKET_BYTES` (64-byte
aligned), each bucket one `broadcast`; a tensor larger than a bucket goes alone, straight into
the receiver's own tensor. So the transient memory beyond the state itself is one bucket
(256 MiB), not a second pickled copy of a multi-GB drafter + optimizer state; at real widths
that is a few hundred collectives. Under NCCL the buckets travel through the drafter's device.

Failure: the first process that fails by itself (not because a peer went away) publishes its
global rank in the launch (`World.process`: torchrun's RANK, or on a dflashctl group node the
inventory-order rank, `launch_env.launch_rank`; in an M:N run target processes are numbered
too, and a drafter's is not its drafter rank) under one key of the launch's store (first
writer wins); a rank whose collective failed because a peer died reads it, waiting a moment for
the failed one to write it. A process that was killed outright writes nothing: then
`failed_rank` stays unknown (None) and its own node's torchrun agent is the one that knows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer.pipeline.distributed import LaunchStoreError, World, launch_store

BUCKET_BYTES = 256 * 2**20
_ALIGN = 64
FAILED_KEY = "dflash/failed_rank"


@dataclass(frozen=True)
class Slot:
    """Where a tensor was in a state tree (its bytes follow the header)."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def split_tensors(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """`tree` with every tensor replaced by a `Slot`, and the tensors in slot order."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return Slot(len(tensors) - 1, x.dtype, tuple(x.shape))
        if isinstance(x, dict):
            out = copy.copy(x)  # keeps the type and attributes (a state_dict's _metadata)
            for k, v in x.items():
                out[k] = walk(v)
            return out
        if isinstance(x, list | tuple):
            items = [walk(v) for v in x]
            return items if isinstance(x, list) else tuple(items)
        return x

    return walk(tree), tensors


def fill_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of `split_tensors`."""
    if isinstance(skeleton, Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        out = copy.copy(skeleton)
        for k, v in skeleton.items():
            out[k] = fill_tensors(v, tensors)
        return out
    if isinstance(skeleton, list | tuple):
        items = [fill_tensors(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton


def _slots(skeleton: Any) -> list[Slot]:
    found: list[Slot] = []

    def walk(x: Any) -> None:
        if isinstance(x, Slot):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    walk(skeleton)
    return sorted(found, key=lambda s: s.index)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _buckets(slots: list[Slot], limit: int) -> list[list[tuple[Slot, int]]]:
    """Slots grouped into buckets of at most `limit` bytes (with each one's offset); a slot
    larger than `limit` is a bucket of its own. Both sides compute the same grouping."""
    out: list[list[tuple[Slot, int]]] = []
    cur: list[tuple[Slot, int]] = []
    used = 0
    for s in slots:
        n = s.nbytes
        if n > limit:
            out.append([(s, 0)])
            continue
        if cur and used + n > limit:
            out.append(cur)
            cur, used = [], 0
        cur.append((s, used))
        used += -(-n // _ALIGN) * _ALIGN
    if cur:
        out.append(cur)
    return out


def broadcast_tensors(
    slots: list[Slot],
    tensors: list[torch.Tensor] | None,
    device: torch.device,
    bucket_bytes: int | None = None,
) -> list[torch.Tensor]:
    """Rank 0's `tensors` (CPU) on every rank, in `slots` order; the others pass None."""
    bucket_bytes = bucket_bytes or BUCKET_BYTES
    main = tensors is not None
    out: list[torch.Tensor] = (
        list(tensors) if tensors is not None else [torch.empty(0) for _ in slots]
    )
    for bucket in _buckets(slots, bucket_bytes):
        if len(bucket) == 1 and bucket[0][0].nbytes > bucket_bytes:
            s = bucket[0][0]
            if not main:
                out[s.index] = torch.empty(s.shape, dtype=s.dtype)
            _broadcast_bytes(_bytes(out[s.index]), device, write_back=not main)
            continue
        last, end = bucket[-1]
        buf = torch.empty(end + last.nbytes, dtype=torch.uint8)
        if main:
            for s, off in bucket:
                if s.nbytes:
                    buf[off : off + s.nbytes].copy_(_bytes(out[s.index]))
        _broadcast_bytes(buf, device, write_back=not main)
        if not main:
            for s, off in bucket:
                raw = buf[off : off + s.nbytes]
                out[s.index] = raw.view(s.dtype).reshape(s.shape).clone()
    return out


def _broadcast_bytes(buf: torch.Tensor, device: torch.device, *, write_back: bool) -> None:
    """Broadcast a CPU byte tensor from rank 0, through `device` (NCCL needs CUDA)."""
    if not buf.numel():
        return
    if device.type == "cpu":
        dist.broadcast(buf, src=0)
        return
    moved = buf.to(device)
    dist.broadcast(moved, src=0)
    if write_back:
        buf.copy_(moved)


def share_object(obj: object, world: World, device: torch.device) -> object:
    """Rank 0's small picklable `obj` on every rank."""
    if not world.distributed:
        return obj
    box = [obj if world.is_main else None]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]


def share_state(
    state: dict[str, Any] | None, header: dict[str, Any], world: World, device: torch.device
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Rank 0's `header` (small, pickled) and `state` (a checkpoint; None: none) on every rank;
    the others pass placeholders. Returns (header, state)."""
    if not world.distributed:
        return header, state
    skeleton: Any = None
    tensors: list[torch.Tensor] | None = None
    if world.is_main and state is not None:
        skeleton, tensors = split_tensors(state)
    got = share_object({**header, "skeleton": skeleton}, world, device)
    assert isinstance(got, dict)
    skeleton = got.pop("skeleton")
    if skeleton is None:
        return got, None
    full = broadcast_tensors(_slots(skeleton), tensors, device)
    return got, fill_tensors(skeleton, full)


def peer_failure(exc: BaseException) -> bool:
    """The exception is a collective that failed because another rank went away."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        m in text for m in ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL")
    )


def first_failed_rank(exc: BaseException | None, world: World, wait_s: float = 3.0) -> int | None:
    """The global rank that failed first as far as this rank knows: itself when its own
    failure came first (published for the others), a peer's published rank when its
    collective failed because that peer died, None when unknown (a peer killed outright)."""
    if not world.distributed:
        return None
    if exc is not None and not peer_failure(exc):
        return publish_failure(world.process, wait_s)
    return published_failure(wait_s)


def publish_failure(rank: int, wait_s: float = 3.0) -> int:
    """This process (torchrun global rank `rank`) failed by itself: publish it unless another
    rank did first; returns the first published rank (`rank` when the store is unreachable)."""
    try:
        got = launch_store(timedelta(seconds=wait_s)).compare_set(FAILED_KEY, "", str(rank))
        return int(got) if got else rank
    except (LaunchStoreError, RuntimeError, ValueError):  # no store: only this rank is known
        return rank


def published_failure(wait_s: float = 3.0) -> int | None:
    """The rank another process published within `wait_s` (None: none did, or no store)."""
    try:
        store = launch_store(timedelta(seconds=wait_s))
        store.wait([FAILED_KEY], timedelta(seconds=wait_s))
        return int(store.get(FAILED_KEY))
    except (LaunchStoreError, RuntimeError, ValueError):  # nobody published within wait_s
        return None

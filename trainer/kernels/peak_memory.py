"""Peak tensor memory of a callable, measured rather than estimated (benchmarks and tests use it).

CUDA has a peak counter (`max_memory_allocated`). The CPU allocator has none, so the call runs
under torch.profiler with profile_memory=True and the allocator's allocation/free events (size and
timestamp of every tensor the CPU allocator hands out or takes back) are replayed in time order;
the peak of the running sum is the peak allocation. RSS sampling would miss short peaks and count
allocator caching; this counts live tensor bytes exactly. Relies on the profiler's event tree
(`experimental_event_tree`), present since torch 2.0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def _walk(nodes: list[Any]) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def cpu_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of live CPU tensor bytes allocated while fn runs, above what existed before it."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocs = [n for n in _walk(tree) if n.tag == _EventType.Allocation]
    allocs.sort(key=lambda n: n.start_time_ns)
    live = peak = 0
    for node in allocs:
        if node.extra_fields.device.type != "cpu":
            continue
        live += node.extra_fields.alloc_size
        peak = max(peak, live)
    return peak


def cuda_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of CUDA bytes allocated while fn runs, above the allocation before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base

"""The memory estimate's per-op byte counts (trainer.memory.costs) against measured peaks on CPU.

Every grid point runs one real drafter forward+backward (SDPA, chunked CE) and measures the peak
of live tensor bytes with the allocator profiler (trainer.kernels.peak_memory.cpu_peak_bytes),
in fp32 and under CPU bf16 autocast (whose weight casts are made inside the step, so the
prediction adds the autocast cache). Prints predicted, measured and their ratio side by side.

    .venv/bin/python benchmarks/bench_memory.py
"""

from __future__ import annotations

import itertools

from trainer.memory.costs import Piece, activation_peak
from trainer.memory.measure import measured_peak
from trainer.memory.shapes import DrafterShape

# (hidden, intermediate, layers, heads, kv heads, head dim, vocab)
WIDTHS = [
    (64, 192, 2, 4, 2, 16, 512),
    (128, 384, 3, 8, 2, 16, 1024),
    (96, 256, 2, 6, 3, 16, 768),
    (256, 768, 2, 8, 4, 32, 2048),
]
# (rows, seq, anchors per row, block)
PIECES = [(1, 64, 16, 4), (4, 64, 8, 4), (2, 128, 32, 8), (8, 32, 4, 16), (1, 256, 64, 8)]


def main() -> None:
    print(
        f"{'H':>4} {'I':>4} {'L':>2} {'hq/kv':>5} {'V':>5} {'R':>2} {'S':>4} {'N':>3} {'B':>3} "
        f"{'dtype':>5} {'predicted':>11} {'measured':>11} {'ratio':>6}"
    )
    worst = 0.0
    for (h, i, layers, hq, kv, hd, v), (r, s, n, b), bf16 in itertools.product(
        WIDTHS, PIECES, (False, True)
    ):
        d = DrafterShape(h, i, layers, hq, kv, hd, v, b, 3)
        piece = Piece(r, s, n)
        c = 2 if bf16 else 4
        pred = activation_peak(d, piece, c=c, feature_bytes=c, backend="sdpa")
        pred += 2 * d.linear_params if bf16 else 0
        meas = measured_peak(d, piece, bf16=bf16)
        worst = max(worst, abs(pred / meas - 1))
        print(
            f"{h:>4} {i:>4} {layers:>2} {f'{hq}/{kv}':>5} {v:>5} {r:>2} {s:>4} {n:>3} {b:>3} "
            f"{'bf16' if bf16 else 'fp32':>5} {pred:>11,} {meas:>11,} {pred / meas:>6.3f}",
            flush=True,
        )
    print(f"worst |predicted/measured - 1| = {worst:.1%} over {len(WIDTHS) * len(PIECES) * 2}")


if __name__ == "__main__":
    main()

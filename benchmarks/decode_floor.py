"""How close a W1 decode step's parts come to this machine's floor, and whether overlapping them pays.

A decode step of W1's model in the middle of a run (``--batch`` sequences of ``--context`` tokens) is
mostly two kinds of work one after the other: attention, which reads every sequence's K and V once
(memory-bound), and the layers' linears (compute-bound at this batch). The roofline
(``pagellm/bench/roofline.py``) counts max(bytes / bandwidth, FLOPs / rate) per step, as if the two
overlapped. This script measures, on pools and weights of W1's shapes built here (native kernels):

- attention's read rate on two threads and on one, against a plain read (``max``) of the same pools
  on as many threads;
- attention then the linears on two threads, against attention on one core while the linears run on
  the other (the two kinds side by side): the side-by-side time is the longer of the two halves, and
  one core streams the pools far slower than two (0.91-1.21x the one-after-the-other time, measured).

    python benchmarks/decode_floor.py [--batch 41] [--context 400] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch

from pagellm.kernels import native
from pagellm.worker.cache_engine import kv_shapes

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, BLOCK = 8, 8, 8, 64, 512, 1408, 16  # W1's model


class DecodeParts:
    """One decode step's attention and linears for every layer of W1's model, on random data."""

    def __init__(self, batch: int, context: int) -> None:
        gen = torch.Generator().manual_seed(0)
        blocks = -(-context // BLOCK)
        pool_shape_k, pool_shape_v = kv_shapes(batch * blocks, BLOCK, KV_HEADS, HEAD_DIM)  # the engine's layouts
        self.k_pools = [torch.randn(pool_shape_k, generator=gen).bfloat16() for _ in range(LAYERS)]
        self.v_pools = [torch.randn(pool_shape_v, generator=gen).bfloat16() for _ in range(LAYERS)]
        # Each sequence's blocks one after the other, as the engine allocates them in a fresh pool.
        self.tables = torch.arange(batch * blocks, dtype=torch.int64).view(batch, blocks)
        self.lens = torch.full((batch,), context, dtype=torch.int64)
        self.q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).bfloat16()
        self.out = torch.empty_like(self.q)
        self.scratch = native.scratch_for(HEADS, HEAD_DIM, BLOCK, blocks)
        shapes = [(3 * HIDDEN, HIDDEN, False), (HIDDEN, HIDDEN, False), (2 * INTER, HIDDEN, True),
                  (HIDDEN, INTER, False)]
        def packed(n: int, k: int, gated: bool) -> torch.Tensor:
            return native.pack_linear_weight(torch.randn(n, k, generator=gen).bfloat16() * 0.05, gated)
        self.weights = [[(packed(n, k, gated), n, k, gated) for n, k, gated in shapes] for _ in range(LAYERS)]
        self.inputs = {k: torch.randn(batch, k, generator=gen).bfloat16() for k in (HIDDEN, INTER)}
        self.pool_bytes = sum(p.numel() * p.element_size() for p in self.k_pools + self.v_pools)

    def attention(self) -> None:
        for k, v in zip(self.k_pools, self.v_pools):
            native.paged_decode_attention(self.q, k, v, self.tables, self.lens, self.scratch, HEAD_DIM**-0.5,
                                          out=self.out)

    def linears(self) -> None:
        for layer in self.weights:
            for packed, n, k, gated in layer:
                native.linear_bf16(self.inputs[k], packed, n, gated=gated)

    def plain_read(self) -> None:
        for pool in self.k_pools + self.v_pools:
            pool.view(torch.int16).max()


def median_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def on_one_core(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        torch.set_num_threads(1)  # the kernels take their thread count from the calling thread
        fn()
    return run


def side_by_side(first: Callable[[], None], second: Callable[[], None]) -> None:
    """first on a thread of its own, second on this one, one core each."""
    other = threading.Thread(target=on_one_core(first))
    other.start()
    on_one_core(second)()
    other.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=41, help="decoding sequences (W1's largest batch: 41)")
    parser.add_argument("--context", type=int, default=400, help="tokens each sequence attends")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if native.load() is None or not native.linear_supported():
        raise SystemExit("needs the native kernels with the bfloat16 linear (AVX512-BF16, no AMX)")
    threads = torch.get_num_threads()
    parts = DecodeParts(args.batch, args.context)
    gb = parts.pool_bytes / 1e9
    print(f"W1 decode step parts: batch {args.batch}, context {args.context}, {LAYERS} layers, "
          f"K+V {parts.pool_bytes / 2**20:.0f} MiB; median of {args.repeats}")
    rows = []
    torch.set_num_threads(threads)
    read = median_seconds(parts.plain_read, args.repeats)
    attention = median_seconds(parts.attention, args.repeats)
    linears = median_seconds(parts.linears, args.repeats)
    serial = median_seconds(lambda: (parts.attention(), parts.linears()), args.repeats)
    rows += [(f"plain read of the pools ({threads} threads)", read, gb / read),
             (f"attention ({threads} threads)", attention, gb / attention),
             (f"linears ({threads} threads)", linears, None),
             (f"attention then linears ({threads} threads)", serial, None)]
    torch.set_num_threads(1)
    read_1 = median_seconds(parts.plain_read, args.repeats)
    attention_1 = median_seconds(parts.attention, args.repeats)
    linears_1 = median_seconds(parts.linears, args.repeats)
    torch.set_num_threads(threads)
    overlap = median_seconds(lambda: side_by_side(parts.attention, parts.linears), args.repeats)
    rows += [("plain read of the pools (1 thread)", read_1, gb / read_1),
             ("attention (1 thread)", attention_1, gb / attention_1),
             ("linears (1 thread)", linears_1, None),
             ("attention beside linears (1 core each)", overlap, None)]
    for name, seconds, rate in rows:
        print(f"  {name:44s} {seconds * 1e3:8.2f} ms" + (f"  {rate:5.1f} GB/s" if rate else ""))
    print(f"side by side / one after the other: {overlap / serial:.2f}x; attention reads at "
          f"{read / attention:.0%} of the plain read's rate on {threads} threads")


if __name__ == "__main__":
    main()

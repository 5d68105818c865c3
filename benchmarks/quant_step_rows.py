"""The quantized linears of one decode step, by batch size: every quantized weight of the embedded
SmolLM2 GGUF (or ``--gguf FILE``) against M input rows, through the kernel that decode steps call
(int8 inputs), as each layer's fused projections call it. Prints the time of the whole set per M, its
ratio to M = 1 and the multiply-accumulate rate, median of ``--repeats``.

    python benchmarks/quant_step_rows.py [--rows 1,4,8,16,24,32,64] [--repeats 5] [--float] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGUFReader

from pagellm.kernels import quant
from pagellm.model.default_model import embedded_gguf_path
from pagellm.model.quant_linear import GGML_TYPES

FUSED = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def step_weights(path: str) -> list[tuple[torch.Tensor, int, int]]:
    """(rows of blocks, ggml type, columns) of each fused projection of every layer, as the model loads them."""
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    layers = sorted({int(name.split(".")[1]) for name in tensors if name.startswith("blk.")})
    out = []
    for layer in layers:
        for parts in FUSED:
            found = [tensors[f"blk.{layer}.{p}.weight"] for p in parts]
            types = {t.tensor_type.value for t in found}
            if len(types) != 1 or types.pop() not in GGML_TYPES.values():
                continue
            data = torch.cat([torch.from_numpy(np.array(t.data)).view(torch.uint8).reshape(int(t.shape[1]), -1)
                              for t in found])
            out.append((data.contiguous(), found[0].tensor_type.value, int(found[0].shape[0])))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--rows", default="1,2,4,8,16,24,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--float", action="store_true", help="float inputs (quant_linear.c) instead of int8")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="the process's CPU time instead of wall time (with --threads 1: steadier "
                             "on a shared machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    weights = step_weights(args.gguf or str(embedded_gguf_path()))
    macs = sum(w.shape[0] * k for w, _, k in weights)
    print(f"{len(weights)} projections, {sum(w.numel() for w, _, _ in weights) / 2**20:.1f} MiB, "
          f"{macs / 1e6:.1f} M multiply-adds per row")
    clock = time.process_time if args.cpu_time else time.perf_counter
    base = None
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in {k for _, _, k in weights}}
        outs = [torch.empty(m, w.shape[0]) for w, _, _ in weights]
        times = []
        for _ in range(args.repeats + 1):
            t0 = clock()
            for (w, t, k), out in zip(weights, outs):
                quant.quant_linear_checked(xs[k], w, t, None, out, not args.float)
            times.append(clock() - t0)
        ms = statistics.median(times[1:]) * 1e3
        base = base or ms
        print(f"M={m:3d}  {ms:8.2f} ms  x{ms / base:5.2f} of M=1  {macs * m / ms / 1e6:6.1f} GMAC/s")


if __name__ == "__main__":
    main()

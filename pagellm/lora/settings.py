"""The rules on the LoRA engine arguments (``--enable-lora``, ``--max-loras``, ``--max-lora-rank``,
``--max-cpu-loras``). Light: ``EngineArgs`` checks them."""

from __future__ import annotations

from typing import Any


def check_lora_args(args: Any) -> None:
    """ValueError naming the flag whose value is not valid, or the combination pagellm does not run."""
    for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        v = getattr(args, name)
        if (v is not None or name != "max_cpu_loras") and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name} (--{name.replace('_', '-')}) must be a positive integer, got {v!r}")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise ValueError(f"max_cpu_loras ({args.max_cpu_loras}) must be at least max_loras ({args.max_loras}): the "
                         "adapters of a step are among those loaded; raise --max-cpu-loras or lower --max-loras")
    nnodes = getattr(args, "nnodes", 1)
    if args.enable_lora and isinstance(nnodes, int) and nnodes > 1:
        raise ValueError("--enable-lora with --nnodes > 1 is not supported: every rank loads each adapter from the "
                         "path node 0 resolved, which the other hosts may not have; run the ranks on one host "
                         "(--tensor-parallel-size alone) or drop --enable-lora")
    if args.enable_lora and getattr(args, "runner", "auto") == "pooling":
        raise ValueError("--enable-lora applies to generative models; drop it with --runner pooling")

"""A tensor-parallel worker rank: one of the processes ``TensorParallelDriver`` starts on this node
(``python -m pagellm.engine.tp_worker RANK``, the engine arguments on stdin), or this node's ranks
under ``pagellm serve --node-rank K``. Each loads its share of the model and a KV pool of the blocks
rank 0 sized, by the engine's own start-up (``startup.py``), then runs the forward pass of every step
rank 0 broadcasts. The process group, the step message and the shards are distributed/'s."""

from __future__ import annotations

import dataclasses
import logging

import torch

from pagellm.config import EngineArgs
from pagellm.distributed.sharding import shard_for
from pagellm.distributed.tensor_parallel import (
    follow_steps,
    init_rank,
    local_device,
    local_world_size,
    meeting_point,
    read_worker_args,
    receive_dtype,
    receive_kv_cache_size,
    spawn_local_workers,
)
from pagellm.engine.startup import allocate_kv_cache, resolve_max_model_len
from pagellm.model import loader
from pagellm.model.default_model import default_model_path
from pagellm.model.hf_overrides import apply_hf_overrides
from pagellm.model.hub import local_model_path
from pagellm.model.llama import sliding_window_of
from pagellm.worker.lora_targets import make_lora_manager
from pagellm.worker.model_runner import ModelRunner
from pagellm.worker.sampler import Sampler

logger = logging.getLogger(__name__)

# What spawn_local_workers runs (python -m) for each worker rank.
MODULE = "pagellm.engine.tp_worker"


def worker_main(args: EngineArgs, rank: int) -> None:
    """A worker rank: its share of the model and KV cache, then one forward pass per broadcast step."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    files = loader.resolve_model_files(local_model_path(args) if args.model is not None else default_model_path())
    assert not isinstance(args.hf_overrides, str)  # (EngineArgs parsed its JSON)
    config = apply_hf_overrides(loader.load_config(files.folder), args.hf_overrides)
    device = local_device(loader.resolve_device(args.device), rank, args)
    group = init_rank(args, rank, device, meeting_point(args, rank))
    dtype = receive_dtype(group)  # rank 0's, whatever this host's CPU would have chosen
    torch.manual_seed(args.seed)
    max_model_len = resolve_max_model_len(config, args.max_model_len)
    model = loader.load_model(files, config, dtype, device, args.load_format, max_model_len,
                              shard=shard_for(rank, args.tensor_parallel_size), batch_invariant=args.batch_invariant,
                              lora=args.enable_lora)
    num_blocks, max_model_len, num_cpu_blocks = receive_kv_cache_size(group)
    sized = dataclasses.replace(args, num_kv_blocks=num_blocks, max_model_len=max_model_len)
    cache_engine, _, _ = allocate_kv_cache(sized, model.config, dtype, device, max_model_len, num_cpu_blocks)
    runner = ModelRunner(model, cache_engine, Sampler([], device, args.seed), device,
                         sliding_window=sliding_window_of(config), calculate_kv_scales=args.calculate_kv_scales)
    if args.enable_lora:  # (adapters arrive with their requests' first step, by the path rank 0 checked)
        runner.lora = make_lora_manager(model, args.max_loras, args.max_cpu_loras or args.max_loras,
                                        args.max_lora_rank, dtype, device)
    follow_steps(runner, group)


def run_worker_node(args: EngineArgs) -> int:
    """``--node-rank K > 0``: this node's ranks, until the driver stops them; no HTTP here."""
    local = local_world_size(args)
    first = args.node_rank * local
    procs = spawn_local_workers(args, first + 1, local - 1, MODULE)
    logger.info("node %d of %d: ranks %d-%d of %d, meeting at %s:%d", args.node_rank, args.nnodes, first,
                first + local - 1, args.tensor_parallel_size, args.master_addr, args.master_port)
    try:
        worker_main(args, first)
    finally:
        codes = [p.wait() for p in procs]
    return max([0, *(abs(c) for c in codes)])


if __name__ == "__main__":  # a worker process (spawn_local_workers)
    worker_main(*read_worker_args())

"""Tensor parallelism over torch.distributed: the driver (rank 0, the engine) and its workers.

The scheduler and the KV block accounting live in the driver only. Every rank holds its share of
the model (sharding.py) and a KV pool of the same number of blocks for its own heads, so one block
table serves them all. Each step the driver broadcasts the scheduled metadata (step_message.py),
then every rank runs the same forward pass, the all-reduces inside it keeping them in step; the
driver alone computes logits and samples.

Ranks are processes: ``tensor_parallel_size / nnodes`` on each node, spawned by the node's main
process (on node 0 that is the engine, rank 0; on the other nodes, ``pagellm serve --node-rank K``,
which serves no HTTP). They meet at ``--master-addr:--master-port`` over TCP (gloo on CPU; NCCL for
the model's all-reduces on CUDA, with the step metadata on gloo). A worker that dies stops the
engine with ``WorkerDiedError``: its peers' collectives fail as its sockets close, and the driver
checks its local workers before each step.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagellm.config import EngineArgs
from pagellm.core.runner_output import ModelRunnerOutput
from pagellm.core.sched_output import SchedulerOutput
from pagellm.distributed.step_message import HEADER_LEN, STOP, decode_step, encode_step, stop_header

logger = logging.getLogger(__name__)

# How long a rank waits in a collective (the step metadata, an all-reduce) before giving up: longer
# than any step, short enough that a peer lost without a closed socket does not hang the engine.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot compute another step."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_world_size(args: EngineArgs) -> int:
    return args.tensor_parallel_size // args.nnodes


def threads_per_rank(args: EngineArgs) -> int:
    """``--threads-per-worker``, or this node's cores shared equally by its ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return args.threads_per_worker or max(1, cores // local_world_size(args))


def init_rank(args: EngineArgs, rank: int, device: torch.device) -> Any:
    """Join the process group as ``rank``; returns the group the step metadata travels on."""
    torch.set_num_threads(threads_per_rank(args))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{args.master_addr}:{args.master_port}", rank=rank,
                            world_size=args.tensor_parallel_size, timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend == "nccl" else dist.group.WORLD


def local_device(device: torch.device, rank: int, args: EngineArgs) -> torch.device:
    """Each rank of a node on its own GPU; on a CPU, the same device."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank % local_world_size(args))


ARGS_ENV = "PAGELLM_TP_ENGINE_ARGS"


def spawn_local_workers(args: EngineArgs, first_rank: int, count: int) -> list[subprocess.Popen]:
    """Start ``count`` worker processes as ranks ``first_rank``.. of this node: fresh interpreters
    running this module (no copy of the parent's threads or torch state, and no re-import of the
    user's script, which multiprocessing's spawn would need guarded by ``if __name__ == "__main__"``)."""
    env = {**os.environ, ARGS_ENV: json.dumps(dataclasses.asdict(args))}
    return [subprocess.Popen([sys.executable, "-m", "pagellm.distributed.tensor_parallel", str(rank)], env=env)
            for rank in range(first_rank, first_rank + count)]


class TensorParallelDriver:
    """Rank 0: starts this node's other ranks, shares the KV cache's size, broadcasts each step."""

    def __init__(self, args: EngineArgs, device: torch.device) -> None:
        if args.master_port is None:
            args = dataclasses.replace(args, master_port=free_port())
        self.args = args
        self.world = args.tensor_parallel_size
        self.procs = spawn_local_workers(args, 1, local_world_size(args) - 1)
        logger.info("tensor parallel: %d ranks (%d on this node, %d threads each), meeting at %s:%d", self.world,
                    local_world_size(args), threads_per_rank(args), args.master_addr, args.master_port)
        self.threads_before = torch.get_num_threads()
        self.group = init_rank(args, 0, device)
        self.closed = False
        atexit.register(self.close)

    def share_kv_cache_size(self, num_blocks: int, max_model_len: int) -> None:
        """Tell the workers the KV pool every rank allocates (what rank 0's memory settings gave)."""
        self._broadcast(torch.tensor([num_blocks, max_model_len], dtype=torch.int64))

    def check_workers(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code "
                                      f"{p.returncode}: the engine cannot compute another step")

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            dist.broadcast(tensor, src=0, group=self.group)
        except RuntimeError as e:
            self.check_workers()
            raise WorkerDiedError(f"a tensor-parallel rank stopped answering: {e}") from e

    def execute(self, runner: Any, out: SchedulerOutput) -> ModelRunnerOutput:
        """Send the step to the workers, then run rank 0's share of it."""
        if self.closed:
            raise WorkerDiedError("the tensor-parallel workers were shut down")
        self.check_workers()
        header, payload = encode_step(out)
        self._broadcast(header)
        if payload.numel():
            self._broadcast(payload)
        try:
            return runner.execute(out)  # type: ignore[no-any-return]
        except RuntimeError as e:  # an all-reduce whose peer is gone
            if isinstance(e, WorkerDiedError) or not any(w in str(e) for w in ("Connection", "Gloo", "NCCL", "peer")):
                raise
            self.check_workers()
            raise WorkerDiedError(f"a tensor-parallel rank stopped during the step: {e}") from e

    def close(self) -> None:
        """Stop the workers (they leave their loop) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.poll() is None for p in self.procs):
                dist.broadcast(stop_header(), src=0, group=self.group)
        except RuntimeError:
            pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self.threads_before)


def worker_main(args: EngineArgs, rank: int) -> None:
    """A worker rank: its share of the model and KV cache, then one forward pass per broadcast step."""
    from pagellm.engine.startup import allocate_kv_cache, resolve_max_model_len
    from pagellm.model import loader
    from pagellm.model.llama import sliding_window_of
    from pagellm.worker.model_runner import ModelRunner
    from pagellm.worker.sampler import Sampler

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    files = loader.resolve_model_files(_model_path(args))
    config = loader.load_config(files.folder)
    device = local_device(loader.resolve_device(args.device), rank, args)
    group = init_rank(args, rank, device)
    dtype = loader.resolve_dtype(args.dtype, files.folder, device)
    torch.manual_seed(args.seed)
    max_model_len = resolve_max_model_len(config, args.max_model_len)
    model = loader.load_model(files, config, dtype, device, args.load_format, max_model_len,
                              tensor_parallel=(rank, args.tensor_parallel_size))
    sizes = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(sizes, src=0, group=group)
    num_blocks, max_model_len = sizes.tolist()
    sized = dataclasses.replace(args, num_kv_blocks=num_blocks, max_model_len=max_model_len)
    cache_engine, _, _ = allocate_kv_cache(sized, model.config, dtype, device, max_model_len)
    runner = ModelRunner(model, cache_engine, Sampler([], device, args.seed), device,
                         sliding_window=sliding_window_of(config), calculate_kv_scales=args.calculate_kv_scales)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=group)
        if int(header[0]) == STOP:
            break
        payload = torch.zeros(int(header[2]), dtype=torch.int64)
        if payload.numel():
            dist.broadcast(payload, src=0, group=group)
        runner.forward_only(decode_step(header, payload))
    dist.destroy_process_group()


def _model_path(args: EngineArgs) -> Any:
    from pathlib import Path

    if args.model is not None:
        return Path(args.model)
    from pagellm.model.default_model import default_model_path

    return default_model_path()


def run_worker_node(args: EngineArgs) -> int:
    """``--node-rank K > 0``: this node's ranks, until the driver stops them; no HTTP here."""
    local = local_world_size(args)
    first = args.node_rank * local
    procs = spawn_local_workers(args, first + 1, local - 1)
    logger.info("node %d of %d: ranks %d-%d of %d, meeting at %s:%d", args.node_rank, args.nnodes, first,
                first + local - 1, args.tensor_parallel_size, args.master_addr, args.master_port)
    try:
        worker_main(args, first)
    finally:
        for p in procs:
            p.wait()
    return 0


if __name__ == "__main__":  # a worker process (spawn_local_workers)
    worker_main(EngineArgs(**json.loads(os.environ[ARGS_ENV])), int(sys.argv[1]))

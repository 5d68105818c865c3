"""Tensor parallelism over torch.distributed: the driver (rank 0, the engine) and its workers.

The scheduler and the KV block accounting live in the driver only. Every rank holds its share of
the model (sharding.py) and a KV pool of the same number of blocks for its own heads, so one block
table serves them all. Each step the driver broadcasts the step's plain data (step_message.py: a new
sequence in full once, then what changed), every rank keeps the same state of each sequence from it
(worker/request_state.py) and runs the same forward pass, the all-reduces inside it keeping them in step; the
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
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagellm.config import EngineArgs
from pagellm.core.runner_output import ModelRunnerOutput
from pagellm.core.sched_output import SchedulerOutput
from pagellm.distributed.step_message import HEADER_LEN, STOP, decode_step, encode_step, stop_header
from pagellm.text import plural
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# How long a rank waits in an all-reduce before giving up: longer than any rank lags another within a
# step, short enough that a peer lost without a closed socket does not hang the engine.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# The workers wait for the next step on a group of their own: a server may sit idle for days. (A lost
# rank 0 still shows at once: its sockets close.)
IDLE_TIMEOUT = timedelta(days=365)
# torch dtypes as the driver sends them, so that every rank computes in the dtype rank 0 resolved.
DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16)


# How long a failed collective waits for a dying worker's exit to show, so the error can name it.
WORKER_EXIT_GRACE_S = 3.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot compute another step."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_world_size(args: EngineArgs) -> int:
    return args.local_world_size


def threads_per_rank(args: EngineArgs) -> int:
    """``--threads-per-worker``, or this node's cores shared equally by its ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return args.threads_per_worker or max(1, cores // local_world_size(args))


ARRIVED = "pagellm/arrived"


def meeting_point(args: EngineArgs, rank: int) -> Any:
    """The rendezvous store at ``--master-addr:--master-port`` (rank 0 serves it); every other rank
    says it has arrived, so that rank 0 can watch its workers while it waits (``TensorParallelDriver``)."""
    assert args.master_port is not None
    store = dist.TCPStore(args.master_addr, args.master_port, args.tensor_parallel_size, is_master=rank == 0,
                          wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
    if rank != 0:
        store.add(ARRIVED, 1)
    return store


def init_rank(args: EngineArgs, rank: int, device: torch.device, store: Any) -> Any:
    """Join the process group as ``rank``; returns the group the step metadata travels on."""
    torch.set_num_threads(threads_per_rank(args))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=args.tensor_parallel_size,
                            timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def local_device(device: torch.device, rank: int, args: EngineArgs) -> torch.device:
    """Each rank of a node on its own GPU; on a CPU, the same device."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank % local_world_size(args))


def spawn_local_workers(args: EngineArgs, first_rank: int, count: int, worker_module: str) -> list[subprocess.Popen]:
    """Start ``count`` worker processes as ranks ``first_rank``.. of this node: fresh interpreters
    running ``python -m worker_module RANK`` (the engine's ``pagellm.engine.tp_worker``: no copy of the
    parent's threads or torch state, and no re-import of the user's script, which multiprocessing's
    spawn would need guarded by ``if __name__ == "__main__"``). The engine arguments go through stdin
    (prompts to preload may be larger than an environment allows); the worker reads them with
    ``read_worker_args``."""
    settings = json.dumps(dataclasses.asdict(dataclasses.replace(args, preload_prompts=None)))
    procs = []
    for rank in range(first_rank, first_rank + count):
        p = subprocess.Popen([sys.executable, "-m", worker_module, str(rank)],
                             stdin=subprocess.PIPE, text=True)
        assert p.stdin is not None
        p.stdin.write(settings)
        p.stdin.close()
        procs.append(p)
    return procs


class TensorParallelDriver:
    """Rank 0: starts this node's other ranks (``worker_module``, run as ``python -m``: the engine's
    ``pagellm.engine.tp_worker``), shares the KV cache's size, broadcasts each step."""

    def __init__(self, args: EngineArgs, device: torch.device, dtype: torch.dtype, worker_module: str) -> None:
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process: shut it down first "
                               "(llm.shutdown(), `with LLM(...) as llm:`, or `del llm` and gc.collect())")
        if args.master_port is None:
            args = dataclasses.replace(args, master_port=free_port())
        if device.type == "cuda" and torch.cuda.device_count() < local_world_size(args):
            raise ValueError(f"tensor_parallel_size {args.tensor_parallel_size} over {plural(args.nnodes, 'node')} "
                             f"needs {plural(local_world_size(args), 'GPU')} here, found {torch.cuda.device_count()}")
        self.args = args
        self.world = args.tensor_parallel_size
        self.closed = False
        self.started = False  # every rank has its KV cache and waits for steps
        self.threads_before = torch.get_num_threads()
        self.procs = spawn_local_workers(args, 1, local_world_size(args) - 1, worker_module)
        atexit.register(self.close)
        logger.info("tensor parallel: %d ranks (%d on this node, %s each), meeting at %s:%d", self.world,
                    local_world_size(args), plural(threads_per_rank(args), "thread"), args.master_addr,
                    args.master_port)
        try:
            self.group = self._meet(device)
            self._broadcast(torch.tensor([DTYPE_CODES.index(dtype)], dtype=torch.int64))
        except BaseException:
            self.close()
            raise

    def _meet(self, device: torch.device) -> Any:
        """Wait for every rank at the meeting point, watching this node's workers meanwhile (one that
        exits before it arrives fails the start at once, not when the rendezvous times out), then join
        the process group."""
        store = meeting_point(self.args, 0)
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while store.add(ARRIVED, 0) < self.world - 1:
            self.check_workers()
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"only {store.add(ARRIVED, 0)} of the {self.world - 1} other ranks arrived at "
                                      f"{self.args.master_addr}:{self.args.master_port} within "
                                      f"{COLLECTIVE_TIMEOUT.total_seconds():.0f} s")
            time.sleep(0.05)
        return init_rank(self.args, 0, device, store)

    def share_kv_cache_size(self, num_blocks: int, max_model_len: int, num_cpu_blocks: int) -> None:
        """Tell the workers the KV and swap pools every rank allocates (what rank 0's memory settings and
        the memory it found gave: block ids must mean the same on every rank)."""
        self._broadcast(torch.tensor([num_blocks, max_model_len, num_cpu_blocks], dtype=torch.int64))
        self.started = True

    def check_workers(self, grace_s: float = 0.0) -> None:
        """Raise ``WorkerDiedError`` naming the first worker that has exited. ``grace_s``: how long to
        keep looking, for the failure paths: a killed worker's sockets close before the kernel reports
        its exit, so a collective can fail a moment before ``poll()`` can say why."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    raise WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code "
                                          f"{p.returncode}: the engine cannot compute another step")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            dist.broadcast(tensor, src=0, group=self.group)
        except RuntimeError as e:
            self.check_workers(grace_s=WORKER_EXIT_GRACE_S)
            raise WorkerDiedError(f"a tensor-parallel rank stopped answering: {e}") from e

    def execute(self, runner: ModelRunner, out: SchedulerOutput) -> ModelRunnerOutput:
        """Send the step to the workers, then run rank 0's share of it. Any failure from here on is
        fatal: the other ranks may be waiting in an all-reduce rank 0 never reaches."""
        if self.closed:
            raise WorkerDiedError("the tensor-parallel workers were shut down")
        self.check_workers()
        header, payload = encode_step(out)
        self._broadcast(header)
        self._broadcast(payload)
        try:
            return runner.execute(out)
        except Exception as e:
            self.check_workers(grace_s=WORKER_EXIT_GRACE_S)
            raise WorkerDiedError(f"a step failed with the model split over {self.world} processes, which are "
                                  f"now out of step: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        """Stop the workers (they leave their loop) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.started and all(p.poll() is None for p in self.procs):
                dist.broadcast(stop_header(), src=0, group=self.group)
        except RuntimeError:
            pass
        for p in self.procs:
            try:
                p.wait(timeout=10 if self.started else 0.1)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self.threads_before)


# ------------------------------------------------------------------------------------ a worker rank
# What a worker rank (pagellm/engine/tp_worker.py) receives, in the order the driver sends it.


def read_worker_args() -> tuple[EngineArgs, int]:
    """A worker process's engine arguments (on stdin, from ``spawn_local_workers``) and rank (argv)."""
    return EngineArgs(**json.loads(sys.stdin.read())), int(sys.argv[1])


def receive_dtype(group: Any) -> torch.dtype:
    """The model dtype rank 0 resolved (sent as the driver starts), whatever this host's CPU would choose."""
    code = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(code, src=0, group=group)
    return DTYPE_CODES[int(code)]


def receive_kv_cache_size(group: Any) -> tuple[int, int, int]:
    """``share_kv_cache_size``'s numbers: the KV pool's blocks, max_model_len and the swap pool's blocks."""
    sizes = torch.zeros(3, dtype=torch.int64)
    dist.broadcast(sizes, src=0, group=group)
    num_blocks, max_model_len, num_cpu_blocks = sizes.tolist()
    return num_blocks, max_model_len, num_cpu_blocks


def follow_steps(runner: ModelRunner, group: Any) -> None:
    """Run ``runner``'s forward pass (``ModelRunner.forward_only``) for each step rank 0 broadcasts,
    until it says stop; then leave the process group."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=group)
        if int(header[0]) == STOP:
            break
        payload = torch.zeros(int(header[1]), dtype=torch.int64)
        dist.broadcast(payload, src=0, group=group)
        runner.forward_only(decode_step(payload))
    dist.destroy_process_group()

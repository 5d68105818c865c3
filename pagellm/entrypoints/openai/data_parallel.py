"""``pagellm serve --data-parallel-size N``: N replica servers on internal ports, each pinned to its share
of the cores, behind vLLM's router (``vllm-router``) on the user's ``--host``/``--port``.

Each replica is this same ``pagellm serve`` command line with ``--data-parallel-size 1`` and its own
``127.0.0.1`` port (the command line wins over a ``--config`` file, so the file is read as given). The
router polls the replicas' ``/health`` and ``/get_load`` (``worker_routes.py``) and routes by
``--router-policy``. This process supervises them all: SIGTERM or Ctrl-C stops the router and the
replicas together; a replica that dies is logged and taken out of the router's list, the others keep
serving; the router dying stops everything (exit status 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

from pagellm.entrypoints.openai.launch import free_port

logger = logging.getLogger("pagellm.server")

ROUTER_VERSION = "0.1.17"  # the version tested (pyproject's `router` extra, constraints.txt)
ROUTER_INSTALL = f"pip install vllm-router=={ROUTER_VERSION}  (or: pip install 'pagellm[router]')"
REPLICA_START_TIMEOUT_S = 1800.0


def split_cores(cores: Sequence[int], n: int) -> list[list[int]]:
    """``cores`` dealt into ``n`` contiguous shares, as even as they go (the first shares get one more);
    with fewer cores than replicas, replica ``i`` gets core ``i mod len(cores)`` alone."""
    if n < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
    cores = sorted(cores)
    if not cores:
        raise ValueError("no CPU cores are available to this process")
    if len(cores) < n:
        return [[cores[i % len(cores)]] for i in range(n)]
    base, extra = divmod(len(cores), n)
    shares, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        shares.append(cores[start:start + size])
        start += size
    return shares


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def replica_argv(command_argv: Sequence[str], port: int) -> list[str]:
    """One replica's ``pagellm serve`` arguments: the user's, then its own port (later flags win)."""
    return ["serve", *command_argv, "--data-parallel-size", "1", "--host", "127.0.0.1", "--port", str(port)]


def router_argv(host: str, port: int, worker_urls: Sequence[str], policy: str, metrics_port: int,
                api_key: str | None = None) -> list[str]:
    """vllm-router's arguments: the workers, the policy, its own Prometheus port (its default, 29000, would
    clash between two such servers on a host), a start-up wait as long as a model load may take."""
    argv = ["--host", host, "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-startup-timeout-secs", str(int(REPLICA_START_TIMEOUT_S)), "--health-check-interval-secs", "5",
            "--log-level", "warning"]
    if api_key:  # as vLLM's router takes it (clients' requests carry their own Authorization header)
        argv += ["--api-key", api_key]
    return argv


def check_router_installed() -> None:
    """ValueError saying how to install vllm-router when it is missing."""
    if importlib.util.find_spec("vllm_router") is None:
        raise ValueError("--data-parallel-size > 1 puts the replicas behind vLLM's router, which is not installed: "
                         f"{ROUTER_INSTALL}")


def _pinned(cores: list[int]):  # type: ignore[no-untyped-def]
    def pin() -> None:  # runs in the child before exec
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
    return pin


class DataParallelServer:
    """The replicas and the router, started and stopped together."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n = args.data_parallel_size
        self.shares = split_cores(available_cores(), self.n)
        self.ports = [free_port() for _ in range(self.n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.replicas: list[subprocess.Popen] = []
        self.router: subprocess.Popen | None = None
        self.router_url = f"http://127.0.0.1:{args.port}" if args.host in ("0.0.0.0", "::", "") \
            else f"http://{args.host}:{args.port}"
        self.removed: set[int] = set()
        self.stopping = False

    def start(self) -> None:
        base = [sys.executable, "-m", "pagellm.entrypoints.cli"]
        if len(available_cores()) < self.n:
            logger.warning("%d replicas on %d cores: replicas share cores", self.n, len(available_cores()))
        for i, (port, cores) in enumerate(zip(self.ports, self.shares)):
            env = {**os.environ, "OMP_NUM_THREADS": str(len(cores)), "PAGELLM_DATA_PARALLEL_RANK": str(i)}
            self.replicas.append(subprocess.Popen(base + replica_argv(self.args.command_argv, port), env=env,
                                                  preexec_fn=_pinned(cores)))
            logger.info("replica %d: pid %d, 127.0.0.1:%d, cores %s", i, self.replicas[-1].pid, port, cores)
        keys = self.args.api_key or []
        argv = router_argv(self.args.host, self.args.port, self.urls, self.args.router_policy, free_port(),
                           keys[0] if keys else None)
        self.router = subprocess.Popen([sys.executable, "-m", "vllm_router.launch_router", *argv])
        logger.info("vllm-router: pid %d, %s, policy %s, over %s", self.router.pid, self.router_url,
                    self.args.router_policy, " ".join(self.urls))

    def supervise(self) -> int:
        """Until a signal or the router's end: the exit status."""
        ready = False
        deadline = time.monotonic() + REPLICA_START_TIMEOUT_S
        while not self.stopping:
            assert self.router is not None
            if self.router.poll() is not None:
                logger.error("the router exited with status %s: stopping the replicas", self.router.returncode)
                return 1
            for i, proc in enumerate(self.replicas):
                if proc.poll() is None or i in self.removed:
                    continue
                if not ready:
                    logger.error("replica %d exited with status %s during start-up (its log is above): stopping",
                                 i, proc.returncode)
                    return 1
                self.removed.add(i)
                logger.error("replica %d (pid %d, %s) exited with status %s: its requests in flight are lost; "
                             "the router stops sending it new ones, %d replica(s) keep serving", i, proc.pid,
                             self.urls[i], proc.returncode, self.n - len(self.removed))
                self._remove_worker(self.urls[i])
            if len(self.removed) == self.n:
                logger.error("every replica has exited: stopping the router")
                return 1
            if not ready:
                ready = self._router_ready()
                if ready:
                    logger.info("serving %d replicas on %s", self.n, self.router_url)
                elif time.monotonic() > deadline:
                    logger.error("the router did not come up within %.0f s: stopping", REPLICA_START_TIMEOUT_S)
                    return 1
            time.sleep(0.5)
        return 0

    def _router_ready(self) -> bool:
        try:
            return httpx.get(self.router_url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _remove_worker(self, url: str) -> None:
        # The router's health check would find it too, within its interval; until then requests sent
        # to it would fail (or be retried). Taking it out at once loses none beyond those in flight.
        try:
            httpx.post(f"{self.router_url}/remove_worker", params={"url": url}, timeout=5)
        except httpx.HTTPError as e:
            logger.warning("could not take %s out of the router (%s); its health check will", url, e)

    def stop(self) -> None:
        """SIGTERM to all at once, then wait; whoever outlasts the shutdown timeout is killed."""
        procs = [p for p in [self.router, *self.replicas] if p is not None and p.poll() is None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.shutdown_timeout + 10
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("pid %d did not stop in time: killed", proc.pid)
                proc.kill()
                proc.wait()


def run_data_parallel(args: argparse.Namespace) -> int:
    """Serve with ``args.data_parallel_size`` replicas behind the router; the exit status."""
    check_router_installed()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per poll of the router's /health
    server = DataParallelServer(args)

    def on_signal(signum: int, _frame: object) -> None:
        server.stopping = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        server.start()
        status = server.supervise()
    finally:
        server.stop()
    return status

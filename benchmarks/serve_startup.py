"""How fast `pagellm serve` answers after it is started, and its resident memory once idle.

Starts the server (the embedded default model unless flags say otherwise) ``--runs`` times; each run
sends one chat completion as soon as the port accepts connections, retrying until it is answered, then
reads the server's resident memory (VmRSS) two seconds later and stops it. The first run may prepare
the GGUF file's folder (a cold start); the later ones are warm starts. Prints one line per run and the
server's own start-up phase line of the last run.

    python benchmarks/serve_startup.py [--runs 3] [-- serve flags...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8,
            "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def one_run(pagellm: str, flags: list[str], log: Path, timeout: float) -> tuple[float, float, str]:
    port = free_port()
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen([pagellm, "serve", "--port", str(port), *flags], stdout=out, stderr=subprocess.STDOUT)
    try:
        body = json.dumps(QUESTION).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with status {proc.returncode}; its log: {log}")
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"no answer within {timeout} s; the server's log: {log}")
            try:
                answer = json.load(urllib.request.urlopen(request, timeout=60))
                break
            except OSError:
                time.sleep(0.05)
        answered = time.perf_counter() - t0
        time.sleep(2)
        return answered, resident_mib(proc.pid), answer["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("serve_flags", nargs="*", help="flags for `pagellm serve` (after --)")
    args = parser.parse_args()
    pagellm = shutil.which("pagellm") or str(Path(sys.executable).with_name("pagellm"))
    logs = Path(tempfile.mkdtemp(prefix="serve-startup-"))
    times, memory = [], []
    for run in range(1, args.runs + 1):
        answered, rss, text = one_run(pagellm, args.serve_flags, logs / f"run{run}.log", args.timeout)
        times.append(answered)
        memory.append(rss)
        print(f"run {run}: answered {answered:.1f} s after start, idle RSS {rss:.0f} MiB: {text!r}", flush=True)
    warm = times[1:] or times
    print(f"warm starts: median {statistics.median(warm):.1f} s to the first answer "
          f"(min {min(warm):.1f}, max {max(warm):.1f}); idle RSS median {statistics.median(memory):.0f} MiB")
    for line in (logs / f"run{args.runs}.log").read_text().splitlines():
        if "start-up:" in line or " ready " in line:
            print(line)


if __name__ == "__main__":
    main()

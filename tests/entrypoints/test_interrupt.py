"""Ctrl-C while a command is loading its model: one line saying what was interrupted, exit status 130,
no traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def _as_from_a_terminal() -> None:
    """The command as a shell starts it: Ctrl-C neither ignored nor blocked (whatever this test process
    inherited from the tests before it), and at a lower priority, so this process reacts before the
    command is done."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.nice(19)


def _interrupt_while_loading(llama_path) -> tuple[int, str] | None:
    """Ctrl-C right after the first start-up phase's line; None where the command had already finished
    (the tiny model loads in about a second, and a busy machine can delay this process longer)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pagellm.entrypoints.cli", "generate", "--model", str(llama_path),
                             "--max-tokens", "4", "--num-kv-blocks", "16", "--max-model-len", "64"],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_as_from_a_terminal)
    assert proc.stderr is not None
    lines = []
    deadline = time.monotonic() + 300
    for line in proc.stderr:  # the first phase's line: loading has begun
        lines.append(line)
        if "start-up: reading the model files took" in line or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    err = "".join(lines) + rest
    if proc.returncode == 0 and "the engine ready" in err:
        return None
    return proc.returncode, err


def test_ctrl_c_during_loading_names_the_phase_without_a_traceback(llama_path):
    for _ in range(3):
        result = _interrupt_while_loading(llama_path)
        if result is not None:
            break
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert result is not None, ("the command finished before Ctrl-C three times; this process's SIGINT: "
                                f"{signal.getsignal(signal.SIGINT)}, blocked: {blocked}")
    returncode, err = result
    assert returncode == 130, err
    assert "pagellm: interrupted while " in err and "Traceback" not in err and "KeyboardInterrupt" not in err

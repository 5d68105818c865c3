"""ConstraintCompiler: turns a constraint into a template matcher where no input can harm the server.

Each new constraint is

1. checked against the limits (limits.py): a 400 naming the limit and its flag;
2. tried in the probe process (probe.py), which is killed when it takes longer than the time budget
   and which dies instead of the server when the grammar engine overflows its stack; the probe also
   says whether any output can satisfy the constraint and what one token's mask costs;
3. compiled for real on the compile thread, whose stack is as large as the probe's (so what passed
   the probe cannot overflow it), and its first mask computed there, so that the lexer states every
   sequence shares are built before a step needs them.

All of it runs on the compile thread, at a lower CPU priority than the engine's steps: a request
waiting for its constraint never holds up another request's admission, and never the running steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from pagellm.constraint_limits import ConstraintLimits, constraint_flag
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend_guidance import UNIMPLEMENTED, GuidanceBackend, grammar_text
from pagellm.structured_output.limits import check_constraint

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The stack of the compile thread and of the probe's: deep enough for any grammar within the size
# limit (the grammar engine recurses once per level of nesting). Only the pages used are resident.
STACK_MB = 512
# How much lower than the engine's threads the compile work runs (nice increment).
NICENESS = 10
PROBE_SCRIPT = Path(__file__).with_name("probe.py")


class CompileThread:
    """One long-lived worker thread with a large stack and a low priority, running jobs in order."""

    def __init__(self, name: str = "pagellm-compile") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        previous = threading.stack_size(STACK_MB << 20)
        try:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()
        finally:
            threading.stack_size(previous)

    def submit(self, job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux: a thread's niceness is its own
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
        while (item := self._jobs.get()) is not None:
            job, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as e:
                future.set_exception(e)

    def close(self) -> None:
        self._jobs.put(None)


class Probe:
    """The probe process (probe.py), started on first use and again after it was killed."""

    def __init__(self, backend: GuidanceBackend) -> None:
        self.backend = backend
        self._process: subprocess.Popen[str] | None = None
        self._tokenizer_json: str | None = None

    def tokenizer_json(self) -> str:
        """The tokenizer as the probe reads it (serialized once; the probe drops its padding and
        truncation settings, as llguidance's own loader does)."""
        if self._tokenizer_json is None:
            self._tokenizer_json = self.backend.hf_tokenizer.backend_tokenizer.to_str()
        return self._tokenizer_json

    def _start(self, timeout: float) -> subprocess.Popen[str]:
        process = subprocess.Popen([sys.executable, "-I", str(PROBE_SCRIPT)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._process = process
        self._send({"tokenizer": self.tokenizer_json(), "n_vocab": self.backend.vocab_size,
                    "eos": self.backend.eos_token_ids, "stack_mb": STACK_MB})
        ready = self._receive(timeout)
        if not ready.get("ready"):
            self.kill()
            raise RuntimeError(f"the grammar probe did not start: {ready.get('error', 'it exited')}")
        return process

    def _send(self, message: dict[str, Any]) -> None:
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(json.dumps(message) + "\n")
        self._process.stdin.flush()

    def _receive(self, timeout: float) -> dict[str, Any]:
        """The probe's next line; ``{"timed_out": True}`` or ``{"crashed": True}`` (the probe killed, or
        gone) when it took longer than ``timeout`` or died first."""
        process = self._process
        assert process is not None and process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""
        if not line:
            self.kill()
            return {"crashed": True} if ready else {"timed_out": True}
        result: dict[str, Any] = json.loads(line)
        return result

    def run(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The probe's answer to ``request`` (see probe.py, and ``_receive``)."""
        if self._process is None or self._process.poll() is not None:
            self._start(timeout=60.0)
        try:
            self._send(request)
        except (BrokenPipeError, OSError):
            self.kill()
            return {"crashed": True}
        return self._receive(timeout)

    def kill(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                process.kill()
            process.wait()

    def close(self) -> None:
        self.kill()


@dataclass(frozen=True)
class Refused:
    """Why a constraint was refused: kept (and cached) as text, each request raising a fresh ValueError
    (one exception object raised again and again would grow its traceback every time)."""

    message: str

    def raise_(self) -> NoReturn:
        raise ValueError(self.message)


class ConstraintCompiler:
    """Constraints to template matchers, one at a time on the compile thread (see the module's docstring)."""

    def __init__(self, backend: GuidanceBackend, limits: ConstraintLimits | None = None) -> None:
        self.backend = backend
        self.limits = limits or ConstraintLimits()
        self._thread: CompileThread | None = None
        self._probe = Probe(backend)
        self._lock = threading.Lock()

    def run(self, job: Callable[[], T]) -> Future[T]:
        """``job()`` on the compile thread, after the jobs before it."""
        with self._lock:
            if self._thread is None:
                self._thread = CompileThread()
            return self._thread.submit(job)

    def prepare_probe(self) -> None:
        """Serialize the tokenizer for the probe now (it is sent to every probe started)."""
        self._probe.tokenizer_json()

    def submit(self, so: StructuredOutputsParams, then: Callable[[Any], None] | None = None) -> Future[Any]:
        """Compile ``so`` on the compile thread: a future of its template matcher, or of a ``Refused``
        saying why it is refused. ``then(template)`` runs on that thread after a success."""
        def job() -> Any:
            try:
                template = self.compile(so)
            except ValueError as e:
                return Refused(str(e))
            if then is not None:
                then(template)
            return template

        return self.run(job)

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The template matcher of ``so`` (on the calling thread); ValueError saying why it is refused."""
        check_constraint(so, self.limits)
        what = f"the {so.kind} constraint"
        try:
            verdict = self._verdict(so)
            if so.kind == "json" and any(u in verdict.get("error", "") for u in UNIMPLEMENTED):
                logger.warning("JSON schema keywords not enforced (%s): compiled without them", verdict["error"])
                verdict = self._verdict(so, lenient=True)
        except ValueError:
            raise
        except Exception as e:  # the library's own refusal, whatever its type: the constraint's fault
            raise ValueError(f"invalid structured_outputs.{so.kind}: {type(e).__name__}: {e}") from e
        if "invalid" in verdict:
            raise ValueError(f"the grammar is not valid Lark or GBNF: {verdict['invalid']}")
        if "error" in verdict:
            raise ValueError(f"invalid structured_outputs.{so.kind}: {verdict['error']}")
        if "dead_end" in verdict:
            raise ValueError(f"{what} can never be satisfied: no output matches it (a reference cycle with no way "
                             f"out, or a contradiction)")
        if "later_error" in verdict:
            raise ValueError(f"{what} cannot be enforced: the grammar engine gives up after its first tokens "
                             f"({verdict['later_error']}): simplify it (long literals, large repetition counts "
                             "and long lists of alternatives cost the most)")
        if verdict.get("mask_ms", 0.0) > self.limits.max_mask_ms:
            raise ValueError(f"{what} is too costly to enforce: one token's mask takes {verdict['mask_ms']:.0f} ms "
                             f"of CPU, more than this server allows ({self.limits.max_mask_ms:g} ms, "
                             f"{constraint_flag('max_mask_ms')}): simplify it (long literals and large repetition "
                             "counts cost the most)")
        template = self.backend.matcher(verdict["grammar"])
        if template.is_error():
            raise ValueError(f"invalid structured_outputs.{so.kind}: {template.get_error()}")
        template.deep_copy().compute_bitmask()  # builds the lexer states every copy shares
        return template

    def _verdict(self, so: StructuredOutputsParams, lenient: bool = False) -> dict[str, Any]:
        """What the probe found of ``so`` (see probe.py); ValueError if it died or ran out of time."""
        if so.kind == "grammar":  # converted in the probe (GBNF's converter can be slow)
            request = {"kind": "grammar", "grammar": so.grammar or ""}
        else:
            request = {"kind": "llguidance", "grammar": grammar_text(so, lenient=lenient)}
        timeout = self.limits.compile_timeout
        verdict = self._probe.run(request, timeout)
        if verdict.get("timed_out"):
            raise ValueError(f"the {so.kind} constraint took longer than {timeout:g} s to compile: simplify it, or "
                             f"start the server with a larger {constraint_flag('compile_timeout')}")
        if verdict.get("crashed"):
            raise ValueError(f"the {so.kind} constraint is too deeply nested for the grammar engine: simplify it "
                             "(fewer levels of rules, references or groups)")
        return verdict

    def close(self) -> None:
        with self._lock:
            if self._thread is not None:
                self._thread.close()
                self._thread = None
        self._probe.close()

"""SIGTERM on the real server: streams still running when --shutdown-timeout expires end with a final
chunk (finish_reason "abort") and [DONE], not a cut connection, and the process exits 0 in time."""

from __future__ import annotations

import json
import signal
import time

import httpx

from tests.entrypoints.openai.server_utils import RemoteServer

SHUTDOWN_TIMEOUT = 1.0
# Allowed past the grace period: the server's own budget (2 s) plus slack for a slow, shared machine
# (interpreter and torch teardown after the last response).
EXIT_BUDGET_S = 2.0
SLOW_MACHINE_SLACK_S = 2.0


def read_events(lines) -> list[str]:
    """The SSE data payloads (raises httpx errors on a connection cut mid-body)."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def test_sigterm_aborts_running_streams_with_a_final_chunk_and_done(llama_path):
    # One seat: the second stream waits behind the first, so it cannot finish within the grace period
    # however fast the machine; the first runs 2000 tokens, several seconds here.
    srv = RemoteServer(llama_path, ["--max-model-len", "2048", "--num-kv-blocks", "256", "--max-num-seqs", "1",
                                    "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)])
    try:
        http = httpx.Client(timeout=30)
        completion = {"prompt": "Go", "max_tokens": 2000, "temperature": 0,
                      "ignore_eos": True, "stream": True}
        chat = {"messages": [{"role": "user", "content": "Go"}], "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        ctx1 = http.stream("POST", srv.url + "/v1/completions", json=completion)
        r1 = ctx1.__enter__()
        lines1 = r1.iter_lines()
        assert next(lines1).startswith("data: ")  # generating now
        ctx2 = http.stream("POST", srv.url + "/v1/chat/completions", json=chat)
        r2 = ctx2.__enter__()
        assert r2.status_code == 200
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        events1 = read_events(lines1)  # httpx.RemoteProtocolError here: the stream was cut
        t_end = time.monotonic() - t0
        events2 = read_events(r2.iter_lines())
        for ctx in (ctx1, ctx2):
            ctx.__exit__(None, None, None)
        http.close()
        rc = srv.proc.wait(timeout=30)
        elapsed = time.monotonic() - t0

        for events in (events1, events2):
            assert events[-1] == "[DONE]", events[-3:]
            finals = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]
            assert finals[-1]["finish_reason"] == "abort", finals[-1]
            assert all(c["finish_reason"] is None for c in finals[:-1])
        # The running stream was given the grace period before it was aborted.
        assert t_end >= SHUTDOWN_TIMEOUT - 0.2, t_end
        assert rc == 0, srv.log()
        assert elapsed < SHUTDOWN_TIMEOUT + EXIT_BUDGET_S + SLOW_MACHINE_SLACK_S, elapsed
        log = srv.log()
        assert "aborted" in log and "Traceback" not in log and "Cancel" not in log, log
    finally:
        srv.stop()

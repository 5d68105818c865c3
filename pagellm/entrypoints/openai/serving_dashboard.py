"""The live KV-cache dashboard: ``GET /dashboard`` (a static page shipped in the package) and the
JSON it polls, ``GET /v1/kv_cache/state``.

The state is read between two engine steps (``AsyncLLMEngine.read_between_steps``), at most once per
``MIN_SNAPSHOT_INTERVAL`` however many pages poll: the pages share the last snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.kv_state import kv_state
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.stats_history import StatsHistory
from pagellm.entrypoints.openai.errors import APIError
from pagellm.outputs import RequestOutput
from pagellm.text import plural

STATE_PATH = "/v1/kv_cache/state"
PAGE_PATH = "/dashboard"
# The page, its script and its stylesheet, by the name the page asks for.
ASSETS = {"index.html": "text/html; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8",
          "dashboard.css": "text/css; charset=utf-8"}
# Paths a browser opens: the API key may come as HTTP Basic credentials there (GuardMiddleware).
BROWSER_PATHS = (PAGE_PATH, STATE_PATH)
# Pages poll a few times a second; one snapshot serves them all within this interval.
MIN_SNAPSHOT_INTERVAL = 0.2
# A long prefill step on a CPU can take seconds; past this the snapshot is given up (503).
SNAPSHOT_TIMEOUT = 30.0
# No CDN, no inline script: the page loads only what this server sends.
_PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
}


def engine_settings(engine: LLMEngine, model_name: str) -> dict[str, Any]:
    """The settings the engine runs with: its flags, and what start-up resolved from them."""
    args = dataclasses.asdict(engine.args)
    if isinstance(args.get("preload_prompts"), list):  # the prompts themselves can be long: their count
        args["preload_prompts"] = plural(len(args["preload_prompts"]), "prompt")
    manager = engine.kv_cache_manager
    sched = engine.scheduler.config
    resolved = {
        "served_model_name": model_name,
        "model_path": str(engine.model_path),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "device": str(engine.device),
        "max_model_len": engine.max_model_len,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "num_kv_blocks": manager.num_blocks,
        "num_cpu_blocks": manager.num_cpu_blocks,
        **weight_settings(engine),
    }
    # Resolved values first; the flags as given after, without repeating a name.
    return {**resolved, **{k: v for k, v in args.items() if k not in resolved}}


def weight_settings(engine: LLMEngine) -> dict[str, Any]:
    """How the weights are stored: ``quantization`` as resolved (a GGUF file's blocks kept, or not), and
    for a GGUF file its type as llama.cpp names it (``Q4_1``) and its tensors' types."""
    from pagellm.model.quant_linear import QuantLinear

    gguf = engine.model_files.gguf
    kept = any(isinstance(m, QuantLinear) for m in engine.model.modules())
    out: dict[str, Any] = {"quantization": engine.args.quantization or ("gguf" if kept and gguf else "none")}
    if gguf is not None:
        from pagellm.model.gguf_type import gguf_types

        types = gguf_types(gguf)
        out["gguf_file_type"] = types.file_type
        out["gguf_tensor_types"] = types.tensor_summary()
    return out


class Dashboard:
    """The state snapshot (shared between pages) and the history of the engine's counters."""

    def __init__(self, async_engine: AsyncLLMEngine, model_name: str) -> None:
        self.async_engine = async_engine
        self.model_name = model_name
        self.settings = engine_settings(async_engine.engine, model_name)
        self.history = StatsHistory()
        self._lock = asyncio.Lock()
        self._body: bytes | None = None
        self._taken = -float("inf")

    def on_step(self, outputs: list[RequestOutput]) -> None:
        """Step callback (between steps): a history point when one is due."""
        self._sample(self.async_engine.engine)

    def _sample(self, engine: LLMEngine) -> None:
        if self.history.due():
            self.history.sample(engine.get_stats())

    def _snapshot(self, engine: LLMEngine) -> dict[str, Any]:
        self._sample(engine)  # an idle engine runs no step callbacks: the charts go on from here
        return kv_state(engine.kv_cache_manager, engine.scheduler)

    async def state_json(self) -> bytes:
        """The state as JSON bytes: the last snapshot if recent enough, else a new one."""
        async with self._lock:
            if time.monotonic() - self._taken < MIN_SNAPSHOT_INTERVAL and self._body is not None:
                return self._body
            try:
                state = await asyncio.wait_for(self.async_engine.read_between_steps(self._snapshot),
                                               SNAPSHOT_TIMEOUT)
            except asyncio.TimeoutError:
                raise APIError(503, f"the engine has been in one step for over {SNAPSHOT_TIMEOUT:.0f} s; "
                                    "retry later") from None
            state.update(time=time.time(), model=self.model_name, health=self.async_engine.health(),
                         pending=len(self.async_engine._pending_adds), history=self.history.as_dict(),
                         settings=self.settings)
            # Encoded here, on copies: the engine may step meanwhile.
            self._body = json.dumps(state, separators=(",", ":")).encode()
            self._taken = time.monotonic()
            return self._body


def asset(name: str) -> bytes:
    return resources.files("pagellm.entrypoints.openai").joinpath("dashboard").joinpath(name).read_bytes()


def add_dashboard_routes(app: FastAPI, dashboard: Dashboard) -> None:
    """``GET /dashboard``, its script and stylesheet, and ``GET /v1/kv_cache/state``."""
    files = {name: asset(name) for name in ASSETS}  # read once: a missing file fails at start-up

    @app.get(PAGE_PATH, response_class=HTMLResponse)
    async def page() -> Response:
        return Response(files["index.html"], media_type=ASSETS["index.html"], headers=_PAGE_HEADERS)

    @app.get(PAGE_PATH + "/")
    async def page_slash() -> Response:
        # The page's links are relative to /dashboard: one address only.
        return RedirectResponse(PAGE_PATH, status_code=308)

    @app.get(PAGE_PATH + "/{name}")
    async def page_asset(name: str) -> Response:
        if name not in files or name == "index.html":
            raise APIError(404, f"no such dashboard file: {name!r}")
        return Response(files[name], media_type=ASSETS[name], headers=_PAGE_HEADERS)

    @app.get(STATE_PATH)
    async def state() -> Response:
        return Response(await dashboard.state_json(), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

"""The routes a router reads from a worker (vLLM's router, ``vllm-router``, and SGLang's, which it
derives from): the load, the server's and the model's settings, a health check that generates, and
the prefix cache reset.

``vllm-router`` polls ``GET /get_load`` for its ``power_of_two`` policy (a JSON object whose ``load``
is an integer), reads ``GET /get_server_info`` and ``GET /get_model_info`` when asked for them, and
forwards ``POST /flush_cache`` to every worker. vLLM's own names are served too: ``GET /load``
(``{"server_load": N}``) and ``POST /reset_prefix_cache``.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

import pagellm
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.sampling_params import SamplingParams

# Routes answered without the API key: /health, and /get_load, which vllm-router polls without sending
# its --api-key (its loads would read -1, unknown, and power_of_two would route blind). Both tell only
# counts and states.
KEYLESS_ROUTES = frozenset({"/health", "/get_load"})


def load_report(async_engine: AsyncLLMEngine) -> dict[str, int]:
    """The requests this server holds: ``load`` (all of them, the router's number), and its parts."""
    in_flight = async_engine.num_in_flight()
    waiting = async_engine.num_waiting()
    return {"load": in_flight, "num_reqs": in_flight, "num_waiting_reqs": waiting,
            "num_running_reqs": max(0, in_flight - waiting)}


def server_info(async_engine: AsyncLLMEngine, model_name: str) -> dict[str, Any]:
    """The settings a router may read: the block size its prefix-aware policies hash by, the limits."""
    engine = async_engine.engine
    args = engine.args
    return {"version": pagellm.__version__, "model_path": str(engine.model_path), "served_model_name": model_name,
            "block_size": engine.block_size, "max_model_len": engine.max_model_len,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": args.enable_prefix_caching, "kv_cache_dtype": args.kv_cache_dtype,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": 1}


def add_worker_routes(app: FastAPI, async_engine: AsyncLLMEngine, model_name: str) -> None:
    """The routes above on ``app`` (behind the API key, but for ``KEYLESS_ROUTES``)."""
    engine = async_engine.engine

    @app.get("/get_load")
    async def get_load() -> dict[str, int]:
        return load_report(async_engine)

    @app.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": async_engine.num_in_flight()}

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        return server_info(async_engine, model_name)

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return {"model_path": str(engine.model_path), "tokenizer_path": str(engine.model_path),
                "served_model_name": model_name, "is_generation": True, "max_model_len": engine.max_model_len}

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        # A real one-token generation: a server whose step loop hangs or fails answers 503 here,
        # where /health (which only asks the engine's state) may still answer 200.
        problem = async_engine.health()
        if problem is None:
            try:
                stream = async_engine.add_request(f"health-{uuid.uuid4().hex}", {"prompt_token_ids": [0]},
                                                  SamplingParams(max_tokens=1, temperature=0.0))
                async for _ in stream:
                    pass
            except Exception as e:  # the engine's own error: the check fails, it does not crash
                problem = f"{type(e).__name__}: {e}"
        if problem is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error", "message": problem}, status_code=503)

    async def reset() -> JSONResponse:
        done = await async_engine.read_between_steps(lambda e: e.reset_prefix_cache())
        if done:
            return JSONResponse({"status": "ok", "message": "the prefix cache is empty"})
        return JSONResponse({"status": "error", "message": "requests are running: the prefix cache was kept; "
                                                           "retry once they finish"}, status_code=400)

    app.add_api_route("/flush_cache", reset, methods=["POST"])
    app.add_api_route("/reset_prefix_cache", reset, methods=["POST"])

"""LoRA adapters on the server, as vLLM's: ``--lora-modules name=path`` at start-up, a request picks one
by its ``model`` field, ``GET /v1/models`` lists them with the base model as ``parent``, and with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (or ``PAGELLM_ALLOW_RUNTIME_LORA_UPDATING``)
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change them at run time (behind the
API key, as every route but /health)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel

from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.openai.errors import APIError
from pagellm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

RUNTIME_SWITCHES = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "PAGELLM_ALLOW_RUNTIME_LORA_UPDATING")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """``--lora-modules`` as (name, path): each ``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}``."""
    modules = []
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                obj = json.loads(value)
                modules.append((str(obj["name"]), str(obj["path"])))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: a JSON module needs \"name\" and \"path\"") from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: give name=path (or JSON with name and path)")
        modules.append((name, path))
    return modules


def register_lora_modules(engine: LLMEngine, values: list[str] | None, base_names: list[str]) -> None:
    """The adapters of ``--lora-modules``, each checked now (a bad one stops the start-up)."""
    modules = parse_lora_modules(values)
    if modules and engine.lora is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for name, path in modules:
        if name in base_names:
            raise ValueError(f"--lora-modules: {name!r} is the base model's name; give the adapter another")
        assert engine.lora is not None
        engine.lora.add(name, path)
        logger.info("LoRA adapter %r served from %s", name, path)


def runtime_updates_allowed() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in RUNTIME_SWITCHES)


def lora_of(engine: LLMEngine, model: str | None) -> LoRARequest | None:
    """The adapter a request's ``model`` names, or None (the base model, or a name check_model refuses)."""
    if model is None or engine.lora is None:
        return None
    return engine.lora.registered.get(model)


def adapter_cards(engine: LLMEngine, parent: str, card: Any) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the adapters: ``card(name)`` with the adapter's path and its parent."""
    if engine.lora is None:
        return []
    return [{**card(name), "root": req.lora_path, "parent": parent} for name, req in engine.lora.registered.items()]


def add_lora_routes(app: FastAPI, engine: LLMEngine, parse_body: Any) -> None:
    """The run-time routes, where the switch allows them (otherwise they are not served)."""
    if engine.lora is None or not runtime_updates_allowed():
        return
    logger.warning("runtime LoRA updating is on: /v1/load_lora_adapter and /v1/unload_lora_adapter are served")
    service = engine.lora

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Any:
        body = await parse_body(request, LoadLoRAAdapterRequest)
        if body.lora_name in service.registered:
            raise APIError(400, f"the LoRA adapter '{body.lora_name}' has already been loaded", param="lora_name")
        try:  # (reads the adapter's files: off the event loop)
            await asyncio.to_thread(service.add, body.lora_name, body.lora_path)
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from e
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Any:
        body = await parse_body(request, UnloadLoRAAdapterRequest)
        if body.lora_name not in service.registered:
            raise APIError(404, f"the LoRA adapter '{body.lora_name}' cannot be found", param="lora_name",
                           code="model_not_found")
        service.remove(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

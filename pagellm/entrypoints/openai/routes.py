"""The answer to a request for a route this server does not have: the routes it has, a near miss
(``/v1/completion``), and for the routes of vLLM's server that pagellm does not serve yet, which API
they are."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from starlette.routing import BaseRoute, Route

# vLLM's server routes that pagellm does not serve (yet): path -> the API it is in vLLM.
# (The pooling routes, /v1/embeddings, /score, /rerank ..., are served under --runner pooling, and answer a
# 400 naming it on a generative server: serving_pooling.py.)
# Served under --enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (serving_lora.py).
_LORA_UPDATES = ("LoRA adapter loading at run time, served with --enable-lora and "
                 "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
_DEV = "a development route of vLLM's server (VLLM_SERVER_DEV_MODE)"
VLLM_ROUTES_NOT_SERVED: dict[str, str] = {
    "/v1/load_lora_adapter": _LORA_UPDATES,
    "/v1/unload_lora_adapter": _LORA_UPDATES,
    "/invocations": "SageMaker's invocation route",
    "/ping": "SageMaker's health check (this server's is GET /health)",
    "/server_info": _DEV,
    "/sleep": _DEV,
    "/wake_up": _DEV,
    "/is_sleeping": _DEV,
    "/collective_rpc": _DEV,
    "/start_profile": _DEV,
    "/stop_profile": _DEV,
    "/scale_elastic_ep": "elastic expert parallelism",
    "/is_scaling_elastic_ep": "elastic expert parallelism",
}
# Path prefixes of the same (the audio APIs).
VLLM_PREFIXES_NOT_SERVED: dict[str, str] = {
    "/v1/audio/": "the audio APIs (OpenAI's transcriptions and translations, for speech models)",
}
# Routes served but not worth listing: the dashboard's assets, FastAPI's OAuth2 helper page.
_UNLISTED = ("/dashboard/", "/dashboard/{name}", "/docs/oauth2-redirect")


def served_routes(routes: Iterable[BaseRoute]) -> list[str]:
    """``METHOD /path`` of each route served (HEAD left out where GET is there)."""
    out = []
    for route in routes:
        if not isinstance(route, Route) or route.path in _UNLISTED:
            continue
        methods = sorted((route.methods or set()) - {"HEAD"}) or ["GET"]
        out.append(f"{'|'.join(methods)} {route.path}")
    return out


def vllm_api_of(path: str) -> str | None:
    """The vLLM API at ``path`` that pagellm does not serve, or None."""
    stripped = path.rstrip("/") or "/"
    if stripped in VLLM_ROUTES_NOT_SERVED:
        return VLLM_ROUTES_NOT_SERVED[stripped]
    return next((api for prefix, api in VLLM_PREFIXES_NOT_SERVED.items() if path.startswith(prefix)), None)


def no_such_route(method: str, path: str, routes: list[str]) -> str:
    """The 404's message for ``method path``, given the ``served_routes``."""
    head = f"no such route: {method} {path}"
    api = vllm_api_of(path)
    if api is _LORA_UPDATES:
        head += f" is {api}"
    elif api is not None:
        head += f" is {api} in vLLM's server, which pagellm does not serve yet"
    else:
        paths = sorted({r.split(" ", 1)[1] for r in routes})
        near = difflib.get_close_matches(path.rstrip("/"), paths, n=1, cutoff=0.8)
        if near:
            head += f"; did you mean {near[0]}?"
    return f"{head}. This server's routes: {', '.join(routes)}"

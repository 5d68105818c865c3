"""GET /dashboard and GET /v1/kv_cache/state in the app (no browser): the page and its files, the state's
shape, the API key (Bearer, or Basic from a browser on the dashboard's paths only), --disable-dashboard."""

from __future__ import annotations

import base64
import re

import pytest
from starlette.testclient import TestClient

from pagellm import EngineArgs, LLMEngine
from pagellm.entrypoints.cli import build_parser
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.entrypoints.openai.serving_dashboard import ASSETS

MODEL = "tiny"
KEY = "dash-key"


@pytest.fixture(scope="module")
def engine(llama_path):
    return LLMEngine(EngineArgs(model=str(llama_path), max_model_len=256, num_kv_blocks=48, device="cpu"))


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


BEARER = {"Authorization": f"Bearer {KEY}"}


def test_page_and_its_files_are_served_from_the_package(engine):
    with TestClient(build_app(engine, MODEL)) as http:
        page = http.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        # Everything the page loads comes from this server: relative links, no CDN.
        links = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        links = [link for link in links if not link.startswith("data:")]  # the empty icon: no favicon request
        assert links and all(not link.startswith(("http:", "https:", "//")) for link in links)
        for link in links:
            r = http.get("/" + link)
            assert r.status_code == 200 and r.content, link
        assert http.get("/dashboard/dashboard.js").headers["content-type"].startswith("text/javascript")
        assert http.get("/dashboard/missing.js").status_code == 404
        slash = http.get("/dashboard/", follow_redirects=False)
        assert slash.status_code == 308 and slash.headers["location"] == "/dashboard"
        assert set(ASSETS) == {"index.html", "dashboard.js", "dashboard.css"}


def test_state_describes_pool_requests_history_and_settings(engine):
    with TestClient(build_app(engine, MODEL)) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", "max_tokens": 3})
        assert r.status_code == 200
        r = http.get("/v1/kv_cache/state")
        assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
        state = r.json()
    pool = state["pool"]
    assert pool["num_blocks"] == 48 and len(pool["states"]) == 48 and pool["block_size"] == 16
    assert sum(pool["counts"].values()) == 48 and state["requests"] == []
    assert state["model"] == MODEL and state["health"] is None
    assert state["stats"]["num_generated_tokens"] >= 3
    settings = state["settings"]
    assert settings["num_kv_blocks"] == 48 and settings["max_model_len"] == 256 and settings["block_size"] == 16
    assert settings["served_model_name"] == MODEL and settings["scheduling_policy"] == "fcfs"
    assert set(state["history"]) >= {"t", "kv_usage", "prefix_cache_hit_rate", "preemptions", "throughput"}


def test_api_key_guards_the_dashboard_and_basic_credentials_work_there_only(engine):
    with TestClient(build_app(engine, MODEL, api_key=KEY)) as http:
        for path in ("/dashboard", "/dashboard/dashboard.js", "/v1/kv_cache/state"):
            r = http.get(path)
            # A Basic challenge: the browser asks its user for the key (as the password).
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic"), path
            assert http.get(path, headers=BEARER).status_code == 200, path
            assert http.get(path, headers=basic("operator", KEY)).status_code == 200, path
            assert http.get(path, headers=basic("operator", "wrong")).status_code == 401, path
            assert http.get(path, headers={"Authorization": "Basic !!!"}).status_code == 401, path
        # Elsewhere the API takes Bearer keys only, as before.
        assert http.get("/v1/models", headers=basic("operator", KEY)).status_code == 401
        r = http.get("/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/models", headers=BEARER).status_code == 200


def test_disable_dashboard_removes_both_routes(engine):
    with TestClient(build_app(engine, MODEL, api_key=KEY, enable_dashboard=False)) as http:
        for path in ("/dashboard", "/dashboard/dashboard.js", "/v1/kv_cache/state"):
            assert http.get(path, headers=BEARER).status_code == 404, path
        # No Basic fallback without the dashboard.
        assert http.get("/dashboard", headers=basic("x", KEY)).headers["www-authenticate"] == "Bearer"


def test_disable_dashboard_flag():
    parser = build_parser()
    assert parser.parse_args(["serve"]).disable_dashboard is False
    assert parser.parse_args(["serve", "--disable-dashboard"]).disable_dashboard is True


def test_the_disk_tier_is_in_the_state_the_page_and_metrics(llama_path, tmp_path):
    tiered = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=40, num_kv_blocks=10, block_size=4,
                                  max_num_seqs=1, device="cpu", kv_offload_dir=str(tmp_path / "tier")))
    with TestClient(build_app(tiered, MODEL)) as http:
        assert 'id="disk-info"' in http.get("/dashboard").text
        doc_a, doc_b = list(range(10, 40)), list(range(100, 130))  # 7 full blocks each; the pool holds 10
        for prompt in (doc_a, doc_b, doc_a):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200
        disk = http.get("/v1/kv_cache/state").json()["disk"]
        metrics = http.get("/metrics").text
    tiered.shutdown()
    assert disk["num_blocks"] > 0 and disk["capacity_bytes"] == 64 * 2**30 and disk["hit_blocks"] > 0
    assert f'pagellm_kv_offload_hit_blocks_total{{model_name="{MODEL}"}} {float(disk["hit_blocks"])}' in metrics
    assert "pagellm_kv_offload_written_bytes_total" in metrics

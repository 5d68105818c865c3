"""The pooling app in-process: Matryoshka dimensions, and one bad input failing alone among concurrent
requests."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from pagellm import LLM, EngineArgs
from pagellm.engine.pooling_engine import PoolingEngine
from pagellm.entrypoints.openai.api_server import parse_body
from pagellm.entrypoints.openai.serving_pooling import build_pooling_app
from pagellm.model.default_model import build_encoder_checkpoint


@pytest.fixture(scope="module")
def matryoshka(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_encoder_checkpoint(tmp_path_factory.mktemp("mrl") / "m", "bert", pooling="mean")
    config = json.loads((folder / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def app_for(folder: Path) -> TestClient:
    engine = PoolingEngine(EngineArgs(model=str(folder)), "embed")
    return TestClient(build_pooling_app(engine, ["m"], parse_body, lambda app: None), raise_server_exceptions=False)


def test_matryoshka_dimensions_cut_and_renormalise(matryoshka: Path) -> None:
    full = np.array(LLM(str(matryoshka), runner="pooling").embed("Hello world", use_tqdm=False)[0].outputs.embedding)
    with app_for(matryoshka) as http:
        r = http.post("/v1/embeddings", json={"input": "Hello world", "dimensions": 16})
        cut = np.array(r.json()["data"][0]["embedding"])
        assert cut.shape == (16,) and np.linalg.norm(cut) == pytest.approx(1.0, abs=1e-6)
        np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
        r = http.post("/v1/embeddings", json={"input": "Hello world", "dimensions": 20})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_a_failing_input_fails_only_its_request(matryoshka: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with app_for(matryoshka) as http:
        engine = http.app.state.async_engine.engine  # type: ignore[attr-defined]
        poison = engine.tokenize("poison")[0]
        real_run = engine.runner.run

        def run(batch, task):  # type: ignore[no-untyped-def]
            if any(item.token_ids == poison for item in batch):
                raise RuntimeError("boom")
            return real_run(batch, task)

        monkeypatch.setattr(engine.runner, "run", run)
        texts = ["hello", "poison", "world", "the quick brown fox"] * 3
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda t: http.post("/v1/embeddings", json={"input": t}).status_code, texts))
        assert codes == [500 if t == "poison" else 200 for t in texts]
        assert http.get("/health").status_code == 200


def test_generative_routes_are_refused_and_not_listed(matryoshka: Path) -> None:
    with app_for(matryoshka) as http:
        r = http.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and "--runner generate" in r.json()["error"]["message"]
        r = http.get("/v1/nothing")
        assert r.status_code == 404
        message = r.json()["error"]["message"]
        assert "POST /v1/embeddings" in message and "/v1/chat/completions" not in message


def test_dashboard_reports_pooling_rates_and_latency(matryoshka: Path) -> None:
    with app_for(matryoshka) as http:
        for text in ("hello", "the quick brown fox", "world"):
            assert http.post("/v1/embeddings", json={"input": [text, text]}).status_code == 200
        stats = http.get("/v1/pooling/stats").json()
        assert stats["requests_total"] == 3 and stats["inputs_total"] == 6 and stats["tokens_total"] > 6
        assert stats["requests_by_kind"] == {"embedding": 3}
        assert stats["requests_per_s"] > 0 and stats["tokens_per_s"] > 0 and stats["latency_ms"]["p50"] > 0
        page = http.get("/dashboard")
        assert page.status_code == 200 and "v1/pooling/stats" in page.text

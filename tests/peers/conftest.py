"""Third-party clients against the real `pagellm serve`: one server for the whole package.

The clients are imported inside the tests, so `make test` (which deselects `peers`) collects this
package without them installed; `make test-peers` needs the `peers` extra.
"""

from __future__ import annotations

import openai
import pytest

from tests.entrypoints.openai.server_utils import RemoteServer

API_KEY = "peers-key-123"
MODEL = "tiny"
MESSAGES = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "The capital of France is"},
]


@pytest.fixture(scope="package", autouse=True)
def offline_env(tmp_path_factory):
    """No model hub, no dataset hub, no model-price download (LiteLLM fetches one at import); lm-eval's
    local dataset is cached in a temporary folder, not in ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
        mp.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        mp.setenv("LANGSMITH_TRACING", "false")
        yield


@pytest.fixture(scope="package")
def server(llama_path):
    srv = RemoteServer(llama_path, ["--served-model-name", MODEL, "--max-model-len", "2048",
                                    "--num-kv-blocks", "512"], api_key=API_KEY)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="package")
def reference_chat(server):
    """The greedy chat answer to MESSAGES as the official `openai` client sees it."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)

"""The dashboard's settings name a GGUF model's quantization (the file's type, as llama.cpp names it, and
its tensors' types): a real server on a tiny Q8_0 file; the embedded SmolLM2 file's own type."""

from __future__ import annotations

import httpx
import pytest

from pagellm.model.default_model import DEFAULT_MODEL_INSTALL, embedded_gguf_path
from pagellm.model.gguf_type import gguf_types
from tests.entrypoints.openai.server_utils import RemoteServer


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    from tests.model.gguf_writer import write_gguf

    path = write_gguf(llama_path, tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf", "Q8_0")
    srv = RemoteServer(path, ["--max-model-len", "128", "--kv-cache-memory", "64MiB"])
    yield srv
    assert srv.stop() == 0


def test_the_dashboard_settings_show_the_gguf_quantization(server):
    state = httpx.get(server.url + "/v1/kv_cache/state").json()
    settings = state["settings"]
    # The tiny file has no general.file_type: its type is its quantized tensors' (2-D weights Q8_0, norms F32).
    assert settings["gguf_file_type"] == "Q8_0" and settings["quantization"] == "gguf"
    assert settings["gguf_tensor_types"].startswith("Q8_0: ") and "F32: " in settings["gguf_tensor_types"]
    page = httpx.get(server.url + "/dashboard/dashboard.js").text
    assert "updateSettings(state.settings)" in page  # the page lists every setting it is sent


@pytest.mark.skipif(embedded_gguf_path() is None, reason=f"the embedded model is missing: {DEFAULT_MODEL_INSTALL}")
def test_the_embedded_file_is_q4_1_by_its_general_file_type():
    path = embedded_gguf_path()
    assert path is not None
    types = gguf_types(path)
    assert types.file_type == "Q4_1"
    assert types.tensor_types.most_common(1)[0][0] == "Q4_1" and types.tensor_types["F32"] > 0

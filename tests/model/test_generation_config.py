"""generation_config.json as the default sampling settings (vLLM's --generation-config)."""

from __future__ import annotations

import json
import shutil

import pytest

from pagellm import LLM, SamplingParams
from pagellm.entrypoints.cli import main
from pagellm.model.generation_config import default_sampling_fields


@pytest.fixture(scope="module")
def model_with_defaults(llama_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(llama_path, folder)
    config = json.loads((folder / "generation_config.json").read_text()) if (
        folder / "generation_config.json").exists() else {}
    config.update({"temperature": 0.0, "top_p": 0.5, "max_new_tokens": 3, "do_sample": True})
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_the_files_values_become_the_defaults(model_with_defaults, caplog):
    with caplog.at_level("INFO"):
        llm = LLM(str(model_with_defaults), max_model_len=64, num_kv_blocks=32)
    assert "temperature=0.0, top_p=0.5, max_tokens=3" in caplog.text  # logged once at start-up
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.0, 3)
    (out,) = llm.generate("Hello")
    assert len(out.outputs[0].token_ids) == 3
    # A request that sets them keeps its own values.
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0))
    assert len(out.outputs[0].token_ids) == 5


def test_vllm_setting_ignores_the_file(model_with_defaults):
    llm = LLM(str(model_with_defaults), max_model_len=64, num_kv_blocks=32, generation_config="vllm")
    assert llm.get_default_sampling_params().max_tokens == SamplingParams().max_tokens


def test_generate_command_takes_the_defaults_for_unset_flags(model_with_defaults, capsys):
    assert main(["generate", "--model", str(model_with_defaults), "--max-seq-len", "64", "--num-kv-blocks", "16",
                 "Hello"]) == 0
    assert "(3 tokens, finish_reason=length)" in capsys.readouterr().out
    assert main(["generate", "--model", str(model_with_defaults), "--max-seq-len", "64", "--num-kv-blocks", "16",
                 "--max-tokens", "4", "Hello"]) == 0
    assert "(4 tokens, finish_reason=length)" in capsys.readouterr().out


def test_a_folder_of_another_file_and_bad_values(model_with_defaults, tmp_path):
    assert default_sampling_fields(str(model_with_defaults), tmp_path)["max_tokens"] == 3
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match="sampling values pagellm cannot use.*top_p.*--generation-config vllm"):
        default_sampling_fields("auto", tmp_path)
    with pytest.raises(ValueError, match="is not 'auto', 'vllm' or a folder"):
        default_sampling_fields(str(tmp_path / "missing"), tmp_path)


@pytest.mark.slow
def test_the_server_gives_requests_the_files_defaults(model_with_defaults):
    import openai

    from tests.entrypoints.openai.server_utils import RemoteServer

    srv = RemoteServer(model_with_defaults, ["--max-model-len", "64", "--num-kv-blocks", "32"])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        plain = client.completions.create(model=model, prompt="Hello")
        assert plain.usage.completion_tokens == 3  # max_new_tokens, not OpenAI's 16
        # temperature 0 from the file: greedy, so a second request gives the same text
        assert client.completions.create(model=model, prompt="Hello").choices[0].text == plain.choices[0].text
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}])
        assert chat.usage.completion_tokens == 3
        own = client.completions.create(model=model, prompt="Hello", max_tokens=5)
        assert own.usage.completion_tokens == 5
    finally:
        assert srv.stop() == 0
    assert "default sampling parameters from" in srv.log()

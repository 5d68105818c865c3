"""Model ids from a hub, through the real ``huggingface_hub`` client against a local hub (local_hub.py,
selected with HF_ENDPOINT): what is downloaded, into which cache, GGUF files picked by quantization,
resumed transfers, offline starts and the errors a user meets."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams
from pagellm.model.hub import HubError, HubSettings, download_model, is_hub_id
from tests.hub.local_hub import LocalHub
from tests.model.gguf_writer import write_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def repos(llama_path, tmp_path_factory) -> dict[str, Path]:
    """A safetensors repository (with a file a model never needs), and a GGUF one of three files."""
    root = tmp_path_factory.mktemp("repos")
    plain = root / "tiny"
    shutil.copytree(llama_path, plain)
    (plain / "README.md").write_text("a model card")
    (plain / "training_args.bin").write_bytes(b"\0" * 1000)
    ggufs = root / "tiny-GGUF"
    ggufs.mkdir()
    write_gguf(llama_path, ggufs / "tiny-Q8_0.gguf", "Q8_0")
    write_gguf(llama_path, ggufs / "tiny-F32.gguf", "F32")
    (ggufs / "tiny-Q2_K.gguf").write_bytes(b"GGUF" + b"\0" * 10)  # below 4 bits: never picked by default
    return {"org/tiny": plain, "org/tiny-GGUF": ggufs}


@pytest.fixture
def hub(repos, tmp_path, monkeypatch):
    hub = LocalHub()
    for repo_id, folder in repos.items():
        hub.add(repo_id, folder)
    hub.add("org/gated", repos["org/tiny"], gated=True)
    url = hub.start()
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield hub
    hub.stop()


def test_ids_are_told_from_paths(tmp_path):
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("unsloth/Qwen3-0.6B-GGUF:Q4_K_M")
    assert not is_hub_id("model.gguf") and not is_hub_id("/abs/path") and not is_hub_id("a/b/c")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not is_hub_id(str(tmp_path / "org" / "name"))


def test_a_model_id_downloads_what_the_model_needs_into_the_hub_cache(hub, llama_path, tmp_path):
    folder = download_model("org/tiny", HubSettings())
    assert folder.is_relative_to(tmp_path / "cache") and "models--org--tiny" in str(folder)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert not (folder / "README.md").exists() and not (folder / "training_args.bin").exists()
    # The same greedy tokens as the local folder, through LLM("ORG/NAME").
    want = LLM(str(llama_path), max_model_len=64, num_kv_blocks=16).generate(["Hello"], GREEDY, use_tqdm=False)
    got = LLM("org/tiny", max_model_len=64, num_kv_blocks=16).generate(["Hello"], GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_gguf_repositories_pick_a_file_by_quantization(hub, caplog):
    caplog.set_level("INFO", logger="pagellm.model.hub")
    assert download_model("org/tiny-GGUF:Q8_0", HubSettings()).name == "tiny-Q8_0.gguf"
    assert download_model("org/tiny-GGUF", HubSettings(gguf_file="tiny-F32.gguf")).name == "tiny-F32.gguf"
    # No tag and no Q4_K_M: the smallest file of at least 4 bits (Q8_0, not Q2_K), and the log says so.
    chosen = download_model("org/tiny-GGUF", HubSettings())
    assert chosen.name == "tiny-Q8_0.gguf" and "smallest file of at least 4 bits" in caplog.text
    assert not (chosen.parent / "tiny-Q2_K.gguf").exists()  # only the files chosen ever came down
    with pytest.raises(HubError, match="no GGUF file of Q5_K_M.*tiny-Q8_0.gguf"):
        download_model("org/tiny-GGUF:Q5_K_M", HubSettings())


def test_a_broken_transfer_is_resumed_where_it_stopped(hub, monkeypatch):
    import huggingface_hub.constants as constants

    # (Chunks smaller than the cut, so that what arrived before it is kept: real files are far larger
    # than huggingface_hub's chunks.)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    hub.cut_once["model.safetensors"] = 4096
    folder = download_model("org/tiny", HubSettings())
    source = hub.repos["org/tiny"].folder / "model.safetensors"
    assert (folder / "model.safetensors").read_bytes() == source.read_bytes()
    url = f"/org/tiny/resolve/{hub.repos['org/tiny'].sha}/model.safetensors"
    assert [r for r in hub.requests if r[:2] == ("GET", url)] == [("GET", url, None), ("GET", url, "bytes=4096-")]


def test_offline_starts_use_the_cache_and_say_how_to_fill_it(hub, monkeypatch):
    download_model("org/tiny", HubSettings())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.requests.clear()
    assert (download_model("org/tiny", HubSettings()) / "config.json").is_file()
    assert not hub.requests  # never the network
    with pytest.raises(HubError, match="not in the cache and HF_HUB_OFFLINE is set.*hf download org/tiny-GGUF"):
        download_model("org/tiny-GGUF", HubSettings())


@pytest.mark.parametrize(("model", "settings", "words"), [
    ("org/gated", HubSettings(), "401 unauthorized.*HF_TOKEN"),
    ("org/missing", HubSettings(), "404: no such repository"),
    ("org/tiny", HubSettings(revision="v9"), "404: no revision 'v9'"),
])
def test_what_goes_wrong_is_said(hub, model, settings, words):
    with pytest.raises(HubError, match=words):
        download_model(model, settings)


def test_a_token_opens_a_gated_repository(hub):
    assert (download_model("org/gated", HubSettings(token="hf_test")) / "config.json").is_file()


def test_a_repository_without_weights_lists_what_it_holds(hub, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "README.md").write_text("nothing to load")
    hub.add("org/docs", tmp_path / "docs")
    with pytest.raises(HubError, match="no weights pagellm reads.*README.md"):
        download_model("org/docs", HubSettings())


def test_no_hub_at_all_is_said(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(HubError, match="cannot be reached|not in the cache"):
        download_model("org/tiny", HubSettings())


@pytest.fixture
def small_disk(tmp_path):
    """A 300 KiB file system (tmpfs): room for the small files, not for the weights."""
    import subprocess

    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (mount -t tmpfs)")
    yield disk
    subprocess.run(["umount", str(disk)], check=False)


def test_a_full_disk_is_said_and_leaves_no_half_model(hub, small_disk):
    with pytest.raises(HubError, match="disk filled up.*--download-dir"):
        download_model("org/tiny", HubSettings(cache_dir=str(small_disk)))
    assert not list(small_disk.rglob("snapshots/*/model.safetensors"))
    assert not list(small_disk.rglob("*.incomplete"))  # nor a part of it taking the little room left


def run_cli(hub, tmp_path, *args: str, chunk_size: int | None = None):
    """``pagellm ARGS`` in a new process on the local hub; ``chunk_size``: huggingface_hub's download
    chunks (smaller than a cut, so that what arrived before it reaches the disk: real files are far
    larger than its chunks)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_ENDPOINT": hub.server_url, "HF_HUB_CACHE": str(tmp_path / "cache")}
    env.pop("HF_HUB_OFFLINE", None)
    command = ["-m", "pagellm.entrypoints.cli"]
    if chunk_size is not None:
        command = ["-c", "import sys, huggingface_hub.constants as c; "
                         f"c.DOWNLOAD_CHUNK_SIZE = {chunk_size}; "
                         "from pagellm.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))"]
    return subprocess.run([sys.executable, *command, *args], capture_output=True, text=True, env=env, timeout=300)


def test_an_interrupted_download_is_resumed_by_the_next_start(hub, tmp_path):
    # The first start: the hub cuts the weights after 4096 bytes, then answers 503 to everything (the
    # client's own retry fails too); the start fails, says so, and keeps what arrived.
    hub.cut_once["model.safetensors"] = 4096
    hub.down_after_cut = True
    generate = ("generate", "--model", "org/tiny", "--max-model-len", "64", "--max-tokens", "4", "--temperature",
                "0", "Hello")
    first = run_cli(hub, tmp_path, *generate, chunk_size=1024)
    source = hub.repos["org/tiny"].folder / "model.safetensors"
    assert first.returncode == 2, first.stderr
    assert f"broke off after 4096 of {source.stat().st_size} bytes" in first.stderr
    assert "start again (the same command) to resume" in first.stderr and "Traceback" not in first.stderr
    cache = tmp_path / "cache"
    (partial,) = cache.rglob("blobs/*.incomplete")
    assert partial.read_bytes() == source.read_bytes()[:4096]
    assert not list(cache.rglob("snapshots/*/model.safetensors"))  # nothing half there for a start to read
    # The second start asks for the rest only, and loads the model.
    hub.down = False
    hub.requests.clear()
    second = run_cli(hub, tmp_path, *generate, chunk_size=1024)
    assert second.returncode == 0, second.stderr
    url = f"/org/tiny/resolve/{hub.repos['org/tiny'].sha}/model.safetensors"
    assert [r for r in hub.requests if r[:2] == ("GET", url)] == [("GET", url, "bytes=4096-")]
    (snapshot,) = (cache / "models--org--tiny" / "snapshots").iterdir()
    assert (snapshot / "model.safetensors").read_bytes() == source.read_bytes()
    assert not list(cache.rglob("*.incomplete"))


def test_the_command_line_takes_model_ids_and_says_what_is_wrong(hub, tmp_path):
    done = run_cli(hub, tmp_path, "generate", "--model", "org/tiny-GGUF:Q8_0", "--max-model-len", "64",
                   "--max-tokens", "4", "--temperature", "0", "Hello")
    assert done.returncode == 0, done.stderr
    assert "org/tiny-GGUF: tiny-Q8_0.gguf (the Q8_0 file" in done.stderr
    refused = run_cli(hub, tmp_path, "serve", "org/gated")
    assert refused.returncode == 2 and "pagellm: error: org/gated: 401 unauthorized" in refused.stderr
    assert "HF_TOKEN" in refused.stderr and "Traceback" not in refused.stderr


def test_a_tokenizer_id_downloads_only_the_tokenizer(hub, llama_path, tmp_path):
    llm = LLM(str(llama_path), tokenizer="org/tiny", max_model_len=64, num_kv_blocks=16)
    assert llm.get_tokenizer().encode("Hello") == LLM(str(llama_path), max_model_len=64,
                                                      num_kv_blocks=16).get_tokenizer().encode("Hello")
    (snapshot,) = (tmp_path / "cache" / "models--org--tiny" / "snapshots").iterdir()
    assert (snapshot / "tokenizer.json").is_file() and not (snapshot / "model.safetensors").exists()


def test_a_split_gguf_file_comes_down_whole_and_loads_as_one_model(hub, llama_path, tmp_path):
    split = tmp_path / "split"
    split.mkdir()
    first = write_gguf(llama_path, split / "tiny-Q8_0.gguf", "Q8_0", split_max_tensors=8)
    write_gguf(llama_path, split / "tiny-F32.gguf", "F32")
    hub.add("org/split-GGUF", split)
    path = download_model("org/split-GGUF:Q8_0", HubSettings())
    assert path.name == first.name and len(list(path.parent.glob("tiny-Q8_0-*.gguf"))) == 3
    whole = write_gguf(llama_path, tmp_path / "whole-Q8_0.gguf", "Q8_0")
    want = LLM(str(whole), max_model_len=64, num_kv_blocks=16).generate(["Hello"], GREEDY, use_tqdm=False)
    got = LLM("org/split-GGUF:Q8_0", max_model_len=64, num_kv_blocks=16).generate(["Hello"], GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids

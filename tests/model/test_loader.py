"""Loading HF folders: sharded weights, dtypes, dummy weights, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.model import loader
from tests.helpers import assert_all_blocks_free

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_sharded_checkpoint_loads_and_matches_single_file(llama_path, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = copy_ckpt(llama_path, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    model = AutoModelForCausalLM.from_pretrained(str(llama_path))
    model.save_pretrained(str(sharded), max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    kw = dict(max_model_len=64, num_kv_blocks=16)
    a = LLM(str(llama_path), **kw).generate(["Hello"], GREEDY, use_tqdm=False)[0]
    b = LLM(str(sharded), **kw).generate(["Hello"], GREEDY, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_missing_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*local Hugging Face model folder"):
        LLM(str(tmp_path / "nope"))


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path))


def test_folder_without_weights_is_a_clear_error(llama_path, tmp_path):
    folder = copy_ckpt(llama_path, tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights"):
        LLM(str(folder), max_model_len=64, num_kv_blocks=8)


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported model architecture.*LlamaForCausalLM.*"
                                         "MistralForCausalLM.*Qwen2ForCausalLM"):
        LLM(str(tmp_path))


def test_shape_mismatch_names_the_weight(llama_path, tmp_path):
    folder = copy_ckpt(llama_path, tmp_path / "bad")
    edit_config(folder, intermediate_size=96)
    with pytest.raises(ValueError, match=r"weight 'model.layers.0.mlp.(gate|up|down)_proj.weight' "
                                         r"has shape .* config implies"):
        LLM(str(folder), max_model_len=64, num_kv_blocks=8)


def test_dummy_weights_need_only_the_config(llama_path, tmp_path):
    folder = copy_ckpt(llama_path, tmp_path / "dummy")
    (folder / "model.safetensors").unlink()
    llm = LLM(str(folder), load_format="dummy", max_model_len=64, num_kv_blocks=16)
    (out,) = llm.generate(["Hello"], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 16
    assert_all_blocks_free(llm)


def test_dtype_resolution(llama_path, tmp_path, monkeypatch):
    folder = copy_ckpt(llama_path, tmp_path / "bf16")
    edit_config(folder, dtype="bfloat16")
    cpu = torch.device("cpu")
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: True)
    assert loader.resolve_dtype("auto", folder, cpu) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: False)
    assert loader.resolve_dtype("auto", folder, cpu) == torch.float32
    assert loader.resolve_dtype("float16", folder, cpu) == torch.float16
    assert loader.resolve_dtype("auto", llama_path, cpu) == torch.float32
    with pytest.raises(ValueError, match="dtype must be one of"):
        loader.resolve_dtype("int8", folder, cpu)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees_with_float32(llama_path, dtype):
    kw = dict(max_model_len=64, num_kv_blocks=16)
    ref = LLM(str(llama_path), dtype="float32", **kw).generate(["The capital of France is"], GREEDY, use_tqdm=False)
    llm = LLM(str(llama_path), dtype=dtype, **kw)
    assert llm.llm_engine.cache_engine.kv_caches[0][0].dtype == getattr(torch, dtype)
    out = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)
    # Low precision may drift late in a random model; the first tokens must agree.
    assert out[0].outputs[0].token_ids[:4] == ref[0].outputs[0].token_ids[:4]


def test_kv_cache_too_small_for_one_sequence_fails_at_start_up(llama_path):
    with pytest.raises(ValueError, match=r"holds 4 blocks \(64 tokens\).*max_model_len=128 needs 8 blocks"
                                         r".*--num-kv-blocks"):
        LLM(str(llama_path), max_model_len=128, num_kv_blocks=4)
    with pytest.raises(ValueError, match="max_model_len=4096 is larger than the model's max_position_embeddings=2048"):
        LLM(str(llama_path), max_model_len=4096)


def test_kv_cache_memory_sizes_the_pool(llama_path, caplog):
    # llama fixture: 2 layers, 4 kv heads, head_dim 16, float32: 2*2*16*4*16*4 bytes = 16 KiB per block.
    with caplog.at_level("INFO"):
        llm = LLM(str(llama_path), max_model_len=64, kv_cache_memory="1MiB")
    assert llm.llm_engine.kv_cache_manager.num_blocks == 64
    line = next(r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage())
    assert "64 blocks of 16 tokens = 1024 tokens" in line and "max concurrency at max_model_len=64: 16.00x" in line


def test_unreadable_weights_name_their_file(llama_path, tmp_path):
    folder = copy_ckpt(llama_path, tmp_path / "truncated")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cannot read the weights file .*model.safetensors: .*truncated"):
        LLM(str(folder), max_model_len=64, num_kv_blocks=8)
    index = folder / "model.safetensors.index.json"
    index.write_text("{not json")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json is not a safetensors index"):
        LLM(str(folder), max_model_len=64, num_kv_blocks=8)


def test_devices_and_dtype_aliases(llama_path):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        LLM(str(llama_path), device="tpu", max_model_len=64, num_kv_blocks=8)
    half = LLM(str(llama_path), dtype="half", max_model_len=64, num_kv_blocks=8)  # vLLM's alias of float16
    assert half.llm_engine.cache_engine.kv_caches[0][0].dtype == torch.float16


def test_a_kv_cache_larger_than_memory_is_refused_with_the_flags_to_lower(llama_path):
    with pytest.raises(ValueError, match=r"cannot allocate the KV cache: .* lower --kv-cache-memory, --num-kv-blocks"):
        LLM(str(llama_path), max_model_len=64, kv_cache_memory="100TiB")


def test_a_folder_without_tokenizer_names_the_files_and_the_flag(llama_path, tmp_path):
    folder = tmp_path / "no-tokenizer"
    folder.mkdir()
    for f in llama_path.iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, folder / f.name)
    with pytest.raises(ValueError, match="none of tokenizer.json / tokenizer.model / tokenizer_config.json.*"
                                         "--tokenizer PATH"):
        LLM(str(folder), max_model_len=64, num_kv_blocks=16)
    llm = LLM(str(folder), tokenizer=str(llama_path), max_model_len=64, num_kv_blocks=16)
    assert llm.generate("Hello", SamplingParams(max_tokens=1))[0].outputs[0].token_ids


def test_large_checkpoints_show_loading_progress(llama_path, monkeypatch, capsys):
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)  # the tiny checkpoint counts as large
    LLM(str(llama_path), max_model_len=64, num_kv_blocks=16)
    assert "Loading weights" in capsys.readouterr().err
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 2**40)
    LLM(str(llama_path), max_model_len=64, num_kv_blocks=16)
    assert "Loading weights" not in capsys.readouterr().err

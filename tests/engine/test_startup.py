"""Engine start-up: the default KV and swap pools are sized from the model and the machine (the same
arithmetic as `pagellm plan`), the pools cost no memory until their blocks are used, and each phase is
logged with its time."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import EngineArgs
from pagellm.engine import sizing, startup
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.plan import make_plan

MiB = 2**20


@pytest.fixture
def host_memory(monkeypatch):
    """Pretend this much host memory is available (to the engine's sizing and to `pagellm plan`)."""
    import pagellm.worker.cpu_tuning as cpu_tuning

    def use(available: int) -> None:
        monkeypatch.setattr(startup, "available_host_memory", lambda: available)
        monkeypatch.setattr(cpu_tuning, "available_host_memory", lambda: available)
    return use


def kv_sizing(engine: LLMEngine) -> sizing.KVCacheSizing:
    return sizing.KVCacheSizing.for_model(engine.model.config, engine.args.block_size, engine.dtype)


@pytest.mark.parametrize(("max_model_len", "binds"), [(64, "the scheduler's most"), (2048, "the memory share")])
def test_default_pools_follow_the_model_and_the_machine(llama_path, host_memory, max_model_len, binds):
    host_memory(100 * MiB)
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=max_model_len, dtype="float32"))
    kv = kv_sizing(engine)
    most = engine.args.max_num_seqs * kv.blocks_for(max_model_len)  # blocks 256 sequences could hold
    share = int(100 * MiB * sizing.DEFAULT_KV_SHARE) // kv.bytes_per_block
    blocks = engine.kv_cache_manager.num_blocks
    assert blocks == (most if binds == "the scheduler's most" else share) and blocks == min(most, share)
    swap_blocks = engine.cache_engine.cpu_caches[0][0].shape[0]
    assert swap_blocks == min(blocks * kv.bytes_per_block, int(100 * MiB * sizing.DEFAULT_SWAP_SHARE)) // \
        kv.bytes_per_block


def test_plan_sizes_the_default_pool_as_the_engine_does(llama_path, host_memory):
    """The plan counts the memory left once the weights are loaded; an engine that finds that much
    available then allocates the plan's blocks and swap pool."""
    host_memory(100 * MiB)
    plan = make_plan(llama_path, max_model_len=2048, dtype="float32", device="cpu")
    assert any("sized as the engine sizes it on this machine" in note for note in plan.notes)
    host_memory(100 * MiB - plan.weights_bytes_per_rank)
    engine = LLMEngine(EngineArgs(model=str(llama_path), max_model_len=2048, dtype="float32", device="cpu"))
    assert engine.kv_cache_manager.num_blocks == plan.num_blocks
    assert engine.cache_engine.num_cpu_blocks * plan.kv_bytes_per_block == plan.swap_bytes_per_rank


def resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc for resident memory")
def test_pools_take_memory_only_as_blocks_are_used(llama_path):
    before = resident_bytes()
    llm = LLM(str(llama_path), dtype="float32", max_model_len=256, kv_cache_memory="768MiB", swap_space=0.75)
    grown = resident_bytes() - before
    assert grown < 256 * MiB, f"start-up took {grown / MiB:.0f} MiB for 1.5 GiB of untouched pools"
    # Blocks read before any write are zeros: a prompt's tokens equal those of an engine with a small pool.
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 60))}]
    small = LLM(str(llama_path), dtype="float32", max_model_len=256, num_kv_blocks=32)
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)])


def test_each_start_up_phase_is_logged_with_its_time(llama_path, caplog):
    with caplog.at_level(logging.INFO, logger="pagellm.engine.llm_engine"):
        LLMEngine(EngineArgs(model=str(llama_path), max_model_len=64, num_kv_blocks=16))
    text = caplog.text
    for phase in ("reading the model files", "reading the config and tokenizer", "loading the weights",
                  "allocating the KV cache", "preparing the model runner"):
        assert f"start-up: {phase} took " in text
    assert "the engine ready " in text and "s after the process started (" in text

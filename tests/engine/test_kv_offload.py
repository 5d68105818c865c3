"""The KV tier on disk on the real engine: blocks evicted from memory are read back, by the same
engine and by a new one on the same folder, with the same greedy tokens; bad folders and files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.core.disk_index import SUFFIX
from pagellm.engine.kv_state import kv_state
from pagellm.engine.metrics import EngineMetrics
from tests.helpers import assert_all_blocks_free, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# A pool so small that one 48-token document evicts the other's blocks (block 4: 12 blocks a prompt).
KW = dict(max_model_len=64, block_size=4, num_kv_blocks=20, max_num_seqs=1, swap_space=0)


def prompts() -> list[list[int]]:
    doc_a, doc_b = random_prompts([48, 48], vocab=500, seed=3)
    (q1, q2) = random_prompts([5, 5], vocab=500, seed=4)
    return [doc_a + q1, doc_b + q1, doc_a + q2, doc_b + q2]


def block_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(f"*{SUFFIX}")]


def run(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY,
                                                            use_tqdm=False)]


@pytest.fixture(scope="module")
def want(llama_path) -> list[list[int]]:
    """Each prompt's greedy tokens without a disk tier (float32)."""
    llm = LLM(str(llama_path), enable_prefix_caching=True, **KW)
    return [run(llm, [p])[0] for p in prompts()]


def test_evicted_blocks_come_back_from_disk_with_the_same_tokens(llama_path, tmp_path, want):
    llm = LLM(str(llama_path), kv_offload_dir=str(tmp_path / "tier"), **KW)
    engine = llm.llm_engine
    metrics = EngineMetrics(engine, "m")
    got = [run(llm, [p])[0] for p in prompts()]
    assert got == want
    index, store = engine.kv_cache_manager.disk, engine.model_runner.disk_store
    assert index is not None and store is not None
    # doc_a's blocks were evicted by doc_b's, written out, and read back for the third prompt.
    assert index.hit_blocks >= 10
    store.flush()
    assert store.bytes_written > 0 and store.bytes_read > 0
    assert len(block_files(tmp_path / "tier")) == len(index) > 0
    stats = engine.get_stats()
    assert stats.kv_offload_hit_blocks == index.hit_blocks and stats.kv_offload_failed_reads == 0
    disk = kv_state(engine.kv_cache_manager, engine.scheduler)["disk"]
    assert disk["num_blocks"] == len(index) and disk["bytes"] == index.total_bytes
    assert disk["hit_blocks"] == index.hit_blocks and disk["capacity_bytes"] == 64 * 2**30
    metrics.on_step([])
    text = metrics.render().decode()
    assert f"pagellm_kv_offload_hit_blocks_total{{model_name=\"m\"}} {float(index.hit_blocks)}" in text
    for name in ("read_bytes", "written_bytes", "evictions", "failed_reads"):
        assert f"pagellm_kv_offload_{name}_total" in text
    assert_all_blocks_free(llm)
    llm.llm_engine.shutdown()


def test_a_new_engine_on_the_same_folder_reads_the_blocks(llama_path, tmp_path, want):
    tier = str(tmp_path / "tier")
    first = LLM(str(llama_path), kv_offload_dir=tier, **KW)
    assert run(first, prompts()[:2]) == want[:2]
    # Both documents' blocks reach the disk as the small pool turns over (two more prompts evict them).
    run(first, random_prompts([48, 48], vocab=500, seed=9))
    first.llm_engine.shutdown()  # (finishes the writes)
    files = block_files(tmp_path / "tier")
    assert len(files) >= 20

    second = LLM(str(llama_path), kv_offload_dir=tier, **KW)
    engine = second.llm_engine
    assert run(second, prompts()[2:]) == want[2:]
    # Each document's 12 full blocks (of its 53-token prompt) come from disk, none recomputed.
    assert engine.kv_cache_manager.disk.hit_blocks == 24
    outs = second.generate([{"prompt_token_ids": prompts()[0]}], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want[0]
    assert_all_blocks_free(second)
    engine.shutdown()


def test_a_torn_file_is_a_miss_and_the_tokens_stay_right(llama_path, tmp_path, want):
    tier = tmp_path / "tier"
    first = LLM(str(llama_path), kv_offload_dir=str(tier), **KW)
    run(first, prompts()[:2])
    run(first, random_prompts([48, 48], vocab=500, seed=9))
    first.llm_engine.shutdown()
    files = sorted(block_files(tier))
    for i, path in enumerate(files):  # every file damaged: torn, flipped, emptied
        data = path.read_bytes()
        if i % 3 == 0:
            path.write_bytes(data[: len(data) // 2])
        elif i % 3 == 1:
            path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
        else:
            path.write_bytes(b"")

    second = LLM(str(llama_path), kv_offload_dir=str(tier), **KW)
    engine = second.llm_engine
    assert run(second, prompts()[2:]) == want[2:]
    index = engine.kv_cache_manager.disk
    assert index.hit_blocks == 0 and index.failed_reads > 0
    assert engine.get_stats().kv_offload_failed_reads == index.failed_reads
    assert_all_blocks_free(second)
    engine.shutdown()


def test_the_tier_stays_within_its_size(llama_path, tmp_path, want):
    llm = LLM(str(llama_path), kv_offload_dir=str(tmp_path / "tier"), kv_offload_size="16KiB", **KW)
    engine = llm.llm_engine
    assert [run(llm, [p])[0] for p in prompts()] == want
    index, store = engine.kv_cache_manager.disk, engine.model_runner.disk_store
    store.flush()
    assert index.evicted_files > 0
    on_disk = sum(p.stat().st_size for p in block_files(tmp_path / "tier"))
    assert on_disk == index.total_bytes <= 16 * 1024
    assert_all_blocks_free(llm)
    engine.shutdown()


def test_bad_folders_are_clear_errors_at_start_up(llama_path, tmp_path):
    with pytest.raises(ValueError, match="parent folder .* does not exist"):
        LLM(str(llama_path), kv_offload_dir=str(tmp_path / "missing" / "tier"), **KW)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        LLM(str(llama_path), kv_offload_dir=str(tmp_path / "file"), **KW)
    if os.geteuid() != 0:  # (root writes anywhere)
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(ValueError, match="cannot (write|create)"):
                LLM(str(llama_path), kv_offload_dir=str(ro), **KW)
        finally:
            ro.chmod(0o700)
    with pytest.raises(ValueError, match="kv_offload_size"):
        EngineArgs(kv_offload_dir=str(tmp_path), kv_offload_size="lots")
    with pytest.raises(ValueError, match="prefix caching"):
        EngineArgs(kv_offload_dir=str(tmp_path), enable_prefix_caching=False)
    with pytest.raises(ValueError, match="no-calculate-kv-scales"):
        EngineArgs(kv_offload_dir=str(tmp_path), kv_cache_dtype="fp8")


def test_a_folder_lost_at_run_time_falls_back_to_recomputing(llama_path, tmp_path, want, caplog):
    import shutil

    tier = tmp_path / "tier"
    llm = LLM(str(llama_path), kv_offload_dir=str(tier), **KW)
    shutil.rmtree(tier)  # (as a disk gone read-only or full: every write and read fails)
    with caplog.at_level("WARNING"):
        assert [run(llm, [p])[0] for p in prompts()] == want
    engine = llm.llm_engine
    engine.model_runner.disk_store.flush()
    assert engine.model_runner.disk_store.write_errors > 0 and "cannot write" in caplog.text
    assert engine.kv_cache_manager.disk.hit_blocks == 0
    assert_all_blocks_free(llm)
    engine.shutdown()


def test_two_engines_on_one_folder_at_once_share_the_blocks(llama_path, tmp_path, want):
    # Both start on an empty folder; what one writes, the other finds on its next lookup.
    tier = str(tmp_path / "tier")
    a = LLM(str(llama_path), kv_offload_dir=tier, **KW)
    b = LLM(str(llama_path), kv_offload_dir=tier, **KW)
    assert run(a, prompts()[:2]) == want[:2]
    run(a, random_prompts([48, 48], vocab=500, seed=9))  # both documents evicted to disk
    a.llm_engine.model_runner.disk_store.flush()
    assert run(b, prompts()[2:]) == want[2:]
    assert b.llm_engine.kv_cache_manager.disk.hit_blocks == 24
    # And back: b's own evictions are written beside a's, and a reads them too.
    run(b, random_prompts([48, 48], vocab=500, seed=10))
    b.llm_engine.model_runner.disk_store.flush()
    assert run(a, prompts()[2:]) == want[2:]
    for llm in (a, b):
        assert_all_blocks_free(llm)
        llm.llm_engine.shutdown()


def test_preloaded_prompts_are_written_and_a_restart_preloads_them_from_disk(llama_path, tmp_path):
    tier = str(tmp_path / "tier")
    system = "You are a helpful assistant. " * 2
    kw = {**KW, "num_kv_blocks": 40}
    first = LLM(str(llama_path), kv_offload_dir=tier, preload_prompts=[system], **kw)
    store = first.llm_engine.model_runner.disk_store
    store.flush()
    pinned = first.llm_engine.kv_cache_manager.num_pinned_blocks
    assert pinned > 0 and len(block_files(tmp_path / "tier")) == pinned  # written though never evicted
    want = first.generate([system + "Hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    first.llm_engine.shutdown()
    second = LLM(str(llama_path), kv_offload_dir=tier, preload_prompts=[system], **kw)
    assert second.llm_engine.kv_cache_manager.disk.hit_blocks == pinned
    assert second.generate([system + "Hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    second.llm_engine.shutdown()


CHILD = """
import json, sys
from pagellm import LLM, SamplingParams
path, tier, kw, prompts = json.loads(sys.argv[1])
llm = LLM(path, kv_offload_dir=tier, **kw)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
for p in prompts:
    llm.llm_engine.add_request(str(len(p)) + str(p[0]), {"prompt_token_ids": p}, params, cache_salt="tenant-a")
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
llm.llm_engine.shutdown()
"""


def test_another_process_with_another_hash_seed_reads_the_blocks(llama_path, tmp_path, want):
    # Blocks written by a process whose str hashes differ (PYTHONHASHSEED) are found by this one: the
    # prefix hash is a sha256, the cache salt (a string) included.
    import json
    import subprocess
    import sys

    tier = str(tmp_path / "tier")
    evict = random_prompts([48, 48], vocab=500, seed=9)
    args = json.dumps([str(llama_path), tier, KW, [*prompts()[:2], *evict]])
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", CHILD, args], check=True, env=env, timeout=300, capture_output=True)
    assert len(block_files(tmp_path / "tier")) >= 24
    llm = LLM(str(llama_path), kv_offload_dir=tier, **KW)
    engine = llm.llm_engine
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()[2:]], GREEDY, use_tqdm=False)
    assert engine.kv_cache_manager.disk.hit_blocks == 0  # another salt: other blocks
    for i, p in enumerate(prompts()[2:]):
        request = engine.add_request(f"salted-{i}", {"prompt_token_ids": p}, GREEDY, cache_salt="tenant-a")
        while engine.has_unfinished_requests():
            engine.step()
        assert list(request.seqs[0].output_token_ids) == want[2 + i]
    assert [o.outputs[0].token_ids for o in outs] == want[2:]
    assert engine.kv_cache_manager.disk.hit_blocks == 24
    assert_all_blocks_free(llm)
    engine.shutdown()


def test_blocks_still_cached_at_shutdown_are_written_for_the_next_engine(llama_path, tmp_path, want):
    # A pool large enough that nothing is evicted: stopping writes the cached blocks.
    tier = str(tmp_path / "tier")
    kw = {**KW, "num_kv_blocks": 200}
    first = LLM(str(llama_path), kv_offload_dir=tier, **kw)
    assert run(first, prompts()[:2]) == want[:2]
    assert not block_files(tmp_path / "tier")
    first.shutdown()
    assert len(block_files(tmp_path / "tier")) == len(first.llm_engine.kv_cache_manager.disk) >= 24
    second = LLM(str(llama_path), kv_offload_dir=tier, **kw)
    assert run(second, prompts()[2:]) == want[2:]
    assert second.llm_engine.kv_cache_manager.disk.hit_blocks == 24
    second.shutdown()

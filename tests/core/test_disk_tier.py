"""The KV tier on disk in core: the index, and the scheduler's saves and reads against a fake runner
that tracks what each block holds, so that a prefix hit read from disk is checked to be the right K/V."""

from __future__ import annotations

import os

import pytest

from pagellm.core.disk_index import DiskIndex, block_file_name, parse_block_file_name
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.runner_output import ModelRunnerOutput, SampleResult
from pagellm.core.sched_output import SchedulerOutput
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from tests.core.fake_model import FakeClock, fake_token
from tests.core.utils import create_request

BS = 4


# ------------------------------------------------------------------ index
def test_file_names_round_trip_and_strangers_are_ignored():
    h = 2**127 + 12345
    assert parse_block_file_name(block_file_name(h)) == h
    assert parse_block_file_name(block_file_name(h) + ".123.tmp") is None
    assert parse_block_file_name("notes.kv") is None


def test_index_scans_oldest_first_evicts_least_recently_used_and_finds_new_files(tmp_path):
    folder = tmp_path / "g0"
    folder.mkdir()
    for i, h in enumerate((1, 2, 3)):
        path = folder / block_file_name(h)
        path.write_bytes(b"x" * 10)
        os.utime(path, ns=(i * 10**9, i * 10**9))
    (folder / "junk.tmp").write_bytes(b"y" * 100)
    index = DiskIndex([str(folder)], [10], capacity_bytes=30)
    assert len(index) == 3 and index.total_bytes == 30 and not index.take_deletes()
    index.touch(0, 1)  # 1 becomes the most recently used: 2 is the oldest now
    index.add(0, 4)
    assert index.take_deletes() == [(0, 2)] and index.evicted_files == 1
    assert index.has(0, 1) and not index.has(0, 2) and index.has(0, 4)
    # A file another process wrote since is found on a lookup (and pushes the oldest out).
    (folder / block_file_name(5)).write_bytes(b"z" * 10)
    assert not index.has(0, 5) and index.contains(0, 5)
    assert index.take_deletes() == [(0, 3)]
    # A block whose read failed is not looked up again until it is written anew.
    index.discard(0, 5)
    assert not index.contains(0, 5)
    index.add(0, 5)
    assert index.contains(0, 5)
    index.assert_consistent()


# --------------------------------------------------------- scheduler + fake runner
class FakeRunner:
    """Tracks what each device block holds (the hash of the block of tokens computed into it) and the
    files on 'disk'; checks every save and every prefix hit against it."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.content: dict[int, int | None] = {}
        self.disk: dict[int, int] = {}  # hash -> what the file holds
        self.corrupt: set[int] = set()  # hashes whose files fail their checks
        self.fail_next_step = False

    def step(self) -> SchedulerOutput:
        sched = self.sched
        kv = sched.kv_cache_manager
        out = sched.schedule()
        res = ModelRunnerOutput()
        for moves in out.disk_moves:
            for block_id, h in moves.saves:
                assert self.content.get(block_id) == h, "a block saved to disk does not hold its hash's K/V"
                self.disk[h] = h
        (swap_out, swap_in, copies), = out.block_moves
        assert not swap_out and not swap_in
        for src, dst in copies:
            self.content[dst] = self.content.get(src)
        for moves in out.disk_moves:
            for h in moves.deletes:
                self.disk.pop(h, None)
            for h, block_id in moves.loads:
                if h in self.disk and h not in self.corrupt:
                    self.content[block_id] = self.disk[h]
                else:
                    self.content[block_id] = None
                    res.disk_load_failures.append((0, block_id))
        if self.fail_next_step:  # the step raises: no update
            self.fail_next_step = False
            return out
        for item in out.scheduled:
            seq = sched.seqs_by_id[item.seq_id]
            table = kv.groups[0].block_tables[seq.seq_id]
            # The blocks this step reads (before its start) hold what their tokens' hashes say.
            for i in range(item.start // BS):
                assert self.content.get(table[i].block_id) == kv.groups[0].block_key(seq, i)[0], \
                    f"seq {seq.seq_id} reads block {i} with the wrong K/V"
            end = item.start + item.num_new_tokens
            for i in range(item.start // BS, end // BS):
                self.content[table[i].block_id] = kv.groups[0].block_key(seq, i)[0] if (i + 1) * BS <= seq.num_tokens \
                    else None
            if item.sample:
                res.samples[item.seq_id] = SampleResult(fake_token(seq.num_tokens), -1.0)
        sched.update(out, res)
        kv.assert_consistent()
        return out

    def run_to_end(self, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")


def make(tmp_path, num_blocks=12, capacity=10**6) -> tuple[Scheduler, FakeRunner]:
    folder = tmp_path / "g0"
    folder.mkdir(exist_ok=True)
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    kv.attach_disk(DiskIndex([str(folder)], [100], capacity))
    sched = Scheduler(SchedulerConfig(64, 1, 64), kv, eos_token_ids=[0], clock=FakeClock())
    return sched, FakeRunner(sched)


def doc(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


def test_evicted_blocks_are_saved_and_a_later_hit_reads_them_back(tmp_path):
    sched, runner = make(tmp_path)
    kv = sched.kv_cache_manager
    a, b = doc(33, 100), doc(33, 300)
    for prompt in (a, b):  # b's 9 blocks evict a's (12 blocks in the pool)
        sched.add_request(create_request(prompt_token_ids=prompt, max_tokens=2))
        runner.run_to_end()
    assert runner.disk, "nothing was saved"
    request = create_request(prompt_token_ids=a + [7, 7], max_tokens=2)
    sched.add_request(request)
    out = runner.step()  # the reads, a step ahead of the admission
    assert not out.scheduled and out.disk_moves[0].loads
    read = len(out.disk_moves[0].loads)
    assert kv.has_staged(request.seqs[0])
    out = runner.step()
    assert out.scheduled and request.seqs[0].num_cached_tokens == 8 * BS  # a's 8 full blocks, from memory or disk
    assert not kv.has_staged(request.seqs[0])
    runner.run_to_end()
    assert kv.disk.hit_blocks == read
    assert kv.num_free_blocks == kv.num_blocks


def test_a_failed_read_is_a_miss_and_the_block_is_recomputed(tmp_path):
    sched, runner = make(tmp_path)
    kv = sched.kv_cache_manager
    a, b = doc(33, 100), doc(33, 300)
    for prompt in (a, b):
        sched.add_request(create_request(prompt_token_ids=prompt, max_tokens=2))
        runner.run_to_end()
    runner.corrupt = set(runner.disk)
    request = create_request(prompt_token_ids=a + [7, 7], max_tokens=2)
    sched.add_request(request)
    runner.run_to_end()  # (the fake runner checks every block read holds the right K/V)
    assert kv.disk.hit_blocks == 0 and kv.disk.failed_reads > 0
    assert request.seqs[0].num_output_tokens == 2
    assert kv.num_free_blocks == kv.num_blocks and not kv.groups[0].staged


def test_reads_of_a_step_that_raised_count_as_failed(tmp_path):
    sched, runner = make(tmp_path)
    kv = sched.kv_cache_manager
    a, b = doc(33, 100), doc(33, 300)
    for prompt in (a, b):
        sched.add_request(create_request(prompt_token_ids=prompt, max_tokens=2))
        runner.run_to_end()
    sched.add_request(create_request(prompt_token_ids=a + [7], max_tokens=2))
    runner.fail_next_step = True
    out = runner.step()
    assert out.disk_moves[0].loads and kv.loads_in_flight
    runner.run_to_end()
    assert not kv.loads_in_flight and kv.num_free_blocks == kv.num_blocks
    kv.assert_consistent()


def test_an_aborted_waiting_sequence_returns_its_staged_blocks(tmp_path):
    sched, runner = make(tmp_path)
    kv = sched.kv_cache_manager
    a, b = doc(33, 100), doc(33, 300)
    for prompt in (a, b):
        sched.add_request(create_request(prompt_token_ids=prompt, max_tokens=2))
        runner.run_to_end()
    request = create_request(prompt_token_ids=a + [7], max_tokens=2)
    sched.add_request(request)
    runner.step()
    assert kv.has_staged(request.seqs[0])
    sched.abort_request(request)
    kv.assert_consistent()
    assert kv.num_free_blocks == kv.num_blocks and not kv.groups[0].staged


@pytest.mark.parametrize("seed", range(4))
def test_many_prompts_over_a_small_pool_and_tier_keep_every_invariant(tmp_path, seed):
    import random

    rng = random.Random(seed)
    sched, runner = make(tmp_path, num_blocks=14, capacity=100 * 12)
    sched.config.max_num_seqs = 2
    docs = [doc(4 * rng.randint(2, 6) + 1, 1000 * (i + 1)) for i in range(4)]
    for _ in range(12):
        prompt = rng.choice(docs) + [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
        sched.add_request(create_request(prompt_token_ids=prompt, max_tokens=rng.randint(1, 4)))
        if rng.random() < 0.5:
            runner.run_to_end()
    runner.run_to_end()
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.disk.total_bytes <= 100 * 12
    assert kv.disk.hit_blocks > 0 and kv.disk.evicted_files > 0  # (both paths taken)
    assert set(runner.disk) == {h for (_, h) in kv.disk._entries}

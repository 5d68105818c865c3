"""What each step tells the model runner (runner_view.py): a sequence whole once, then only what
changed. ``fake_step`` checks after every step that the runner's state built from the messages (and a
tensor-parallel worker's, through the encoded step) holds the scheduler's tokens and block tables;
these tests drive the paths that change a table in place or replace it, and the size of the deltas."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.kv_cache_manager import OUT_OF_WINDOW, KVCacheManager
from pagellm.core.sched_output import CachedSeqData, TableEdit
from pagellm.core.scheduler import Scheduler, SchedulerConfig
from pagellm.core.speculation import SpeculativeConfig
from tests.core.fake_model import FakeClock, fake_step, fake_token, run_to_end
from tests.core.utils import create_request, create_scheduler


def edit_of(cached: CachedSeqData) -> TableEdit | None:
    """The one group's table edit a step sent for a sequence (None: its table did not change)."""
    if not cached.block_edits:
        return None
    (edit,) = cached.block_edits
    return edit

def test_a_decode_sends_its_last_token_and_a_block_only_when_it_starts_one():
    sched = create_scheduler(block_size=4)
    request = create_request(10, max_tokens=8)
    sched.add_request(request)
    (seq,) = request.seqs
    first = fake_step(sched)
    (new,) = first.new_seqs
    assert new.prompt_token_ids is seq.prompt_token_ids  # shared, not copied
    assert (new.output_token_ids, new.block_tables, first.cached_seqs) == ([], [[0, 1, 2]], [])
    for _ in range(6):
        before = list(seq.output_token_ids)
        out = fake_step(sched)
        assert out.new_seqs == []
        (cached,) = out.cached_seqs
        assert cached.new_token_ids == before[-1:]  # the token sampled last step, nothing more
        starts_block = out.scheduled[0].start % 4 == 0
        assert (edit_of(cached) is not None) == starts_block
        if starts_block:  # the new block appended, the table's earlier entries kept
            assert (edit_of(cached).keep, len(edit_of(cached).block_ids)) == (out.scheduled[0].start // 4, 1)
    run_to_end(sched)


def test_prefill_chunks_send_the_prompt_once():
    sched = create_scheduler(block_size=4, max_num_batched_tokens=8, max_model_len=64)
    request = create_request(30, max_tokens=2)
    sched.add_request(request)
    outs = run_to_end(sched)
    assert sum(len(o.new_seqs) for o in outs) == 1
    chunks = [o for o in outs if o.scheduled and not o.scheduled[0].sample]
    assert len(chunks) == 3 and all(not c.cached_seqs or not c.cached_seqs[0].new_token_ids for c in chunks)


def test_a_preempted_sequence_is_dropped_and_sent_whole_when_it_returns():
    for mode in ("swap", "recompute"):
        sched = create_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=64, num_cpu_blocks=32,
                                 preemption_mode=mode)
        requests = [create_request(3, max_tokens=6) for _ in range(3)]
        for r in requests:
            sched.add_request(r)
        preempted: set[int] = set()
        resent = False
        while sched.has_unfinished():
            out = fake_step(sched)
            resent |= any(n.seq_id in preempted and n.output_token_ids for n in out.new_seqs)
            preempted |= set(out.preempted_seq_ids)
        assert preempted and resent, mode
        run_to_end(sched)


def test_forked_children_start_from_their_parent_and_get_their_tables_next_step():
    sched = create_scheduler(block_size=4)
    request = create_request(6, max_tokens=5, n=3, seed=11)
    sched.add_request(request)
    out = fake_step(sched)
    (item,) = out.scheduled
    assert [(c.seq_id, c.seed) for c in item.fork_children] == [(s.seq_id, s.seed) for s in request.seqs[1:]]
    out = fake_step(sched)
    assert not out.new_seqs
    edits = {c.seq_id: edit_of(c) for c in out.cached_seqs}
    kv = sched.kv_cache_manager
    for child in request.seqs[1:]:  # the whole table, copied on write where the next token goes
        assert edits[child.seq_id].keep == 0 and edits[child.seq_id].block_ids == kv.groups[0].block_table(child)
    run_to_end(sched)


@settings(max_examples=40, deadline=None)
@given(prompts=st.lists(st.integers(1, 40), min_size=1, max_size=5), window=st.sampled_from([4, 6, 9]),
       block_size=st.sampled_from([2, 4]), budget=st.sampled_from([8, 64]),
       prefix=st.booleans(), mode=st.sampled_from(["swap", "recompute"]))
def test_blocks_leaving_the_window_reach_the_runner(prompts, window, block_size, budget, prefix, mode):
    """A model whose every layer slides (one group): leading blocks become stand-ins in place, under
    chunking, prefix hits, forks and preemption."""
    cfg = SchedulerConfig(budget, 4, 64, preemption_mode=mode)
    kv = KVCacheManager(40, block_size, prefix, num_cpu_blocks=40, sliding_window=window)
    sched = Scheduler(cfg, kv, eos_token_ids=[0], clock=FakeClock())
    for i, n in enumerate(prompts):
        sched.add_request(create_request(prompt_token_ids=[7] * n, max_tokens=20 - 3 * i, n=1 + i % 2))
    dead = False
    while sched.has_unfinished():
        fake_step(sched)
        dead |= any(b is OUT_OF_WINDOW for t in kv.groups[0].block_tables.values() for b in t)
    run_to_end(sched)
    assert dead or max(prompts) + 20 <= window + block_size


def test_kept_drafts_reach_the_runner():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                        "prompt_lookup_max": 3})
    sched = create_scheduler(block_size=4, max_model_len=200, num_blocks=128, max_num_batched_tokens=64,
                             speculative=spec)
    # Prompts that follow the fake model's tokens (period 50): the n-gram drafts are right.
    for n in (60, 75):
        sched.add_request(create_request(prompt_token_ids=[fake_token(i) for i in range(n)], max_tokens=30))
    outs = run_to_end(sched)
    assert sched.stats.num_accepted_tokens > 0
    assert any(len(c.new_token_ids) > 1 for o in outs for c in o.cached_seqs)


def test_a_sequence_computed_again_past_the_switch_gets_its_tables_whole():
    sched = create_scheduler(block_size=4, max_model_len=64, recompute_past_length=12)
    request = create_request(8, max_tokens=10)
    sched.add_request(request)
    outs = run_to_end(sched)
    whole = [c for o in outs for c in o.cached_seqs if (e := edit_of(c)) is not None and e.keep == 0]
    assert len(whole) == 1 and request.seqs[0].num_output_tokens == 10

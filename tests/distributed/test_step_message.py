"""The step message of tensor parallelism (step_message.py): the same plain data as the runner's
``SchedulerOutput`` (but what only rank 0 reads to sample), a sequence's tokens once, then deltas."""

from __future__ import annotations

from pagellm.core.sched_output import (
    CachedSeqData,
    ForkedSeq,
    NewSeqData,
    ScheduledSeq,
    SchedulerOutput,
    TableEdit,
)
from pagellm.distributed.step_message import HEADER_LEN, STEP, STOP, decode_step, encode_step, stop_header
from pagellm.lora.request import LoRARequest
from pagellm.sampling_params import SamplingParams
from tests.core.fake_model import as_a_worker_decodes, fake_step, run_to_end
from tests.core.utils import create_request, create_scheduler


def every_field() -> SchedulerOutput:
    """A step that uses every field, with two KV cache groups."""
    params = SamplingParams(seed=2**64 - 1)  # (a seed int64 could not hold: workers get none)
    return SchedulerOutput(
        scheduled=[
            ScheduledSeq(1, 0, 5, sample=True, prompt_logprobs_range=(1, 4),
                         fork_children=[ForkedSeq(4, 9), ForkedSeq(5, None)]),
            ScheduledSeq(2, 9, 3, sample=True, draft_token_ids=[7, 8]),
            ScheduledSeq(3, 16, 8, sample=False),
        ],
        new_seqs=[NewSeqData(1, [10, 11, 12, 13, 14], [], params, 2**64 - 1, [[3, 4], [5]]),
                  NewSeqData(3, list(range(40)), [1, 2], params, None, [[0, 0, 6, 7, 8], [0, 9, 10]],
                             LoRARequest("sql-é", 7, "/adapters/sql lora"))],
        cached_seqs=[CachedSeqData(2, [15], [TableEdit(2, [11, 12], 0, 1), None]),
                     CachedSeqData(6, [], [None, TableEdit(0, [1, 2])]),
                     CachedSeqData(10, [16])],
        num_batched_tokens=16,
        preempted_seq_ids=[7, 8],
        finished_seq_ids=[9],
        block_moves=[([(1, 2)], [(3, 4), (5, 6)], [(7, 8)]), ([], [(9, 10)], [(11, 12)])],
    )


def test_every_field_round_trips_but_what_only_rank_0_reads():
    out = every_field()
    header, payload = encode_step(out)
    assert header.tolist() == [STEP, payload.numel()] and header.numel() == HEADER_LEN
    back = decode_step(payload)
    assert back == as_a_worker_decodes(out)
    assert back.new_seqs[0].sampling_params is None and back.scheduled[0].fork_children[0].seed is None
    lora = back.new_seqs[1].lora_request  # (equal by name: its id and path too)
    assert lora is not None and (lora.lora_int_id, lora.lora_path) == (7, "/adapters/sql lora")
    assert back.new_seqs[0].lora_request is None
    assert stop_header().tolist() == [STOP, 0]


def test_an_empty_step_round_trips():
    out = SchedulerOutput(finished_seq_ids=[3, 4])
    assert decode_step(encode_step(out)[1]) == out


def test_every_scheduled_step_round_trips():
    sched = create_scheduler(num_blocks=12, block_size=2, max_num_batched_tokens=16, num_cpu_blocks=32,
                             enable_prefix_caching=True)
    for n, k in ((9, 6), (3, 12)):
        sched.add_request(create_request(prompt_token_ids=list(range(3, 3 + n)), max_tokens=k, n=1 + n % 2))
    steps = 0
    while sched.has_unfinished():
        out = fake_step(sched)
        assert decode_step(encode_step(out)[1]) == as_a_worker_decodes(out)
        steps += 1
        if steps == 2:  # the first prompt's blocks are cached by now
            sched.add_request(create_request(prompt_token_ids=list(range(3, 12)), max_tokens=5))
    assert sched.stats.num_preemptions and sched.kv_cache_manager.prefix_cache_hits


def decode_payloads(prompt_len: int) -> list[int]:
    """The payload sizes of the steps of one request of ``prompt_len`` tokens (computed in one step)."""
    sched = create_scheduler(num_blocks=256, block_size=4, max_num_batched_tokens=512, max_model_len=600)
    sched.add_request(create_request(prompt_len, max_tokens=6))
    return [encode_step(out)[1].numel() for out in run_to_end(sched)]


def test_a_step_after_the_first_sends_only_what_changed():
    short, long = decode_payloads(40), decode_payloads(400)
    assert long[0] - short[0] == 360 + 90  # the prompt and its block table, once
    assert long[1:] == short[1:]  # decodes: the last token (and a block when one starts), whatever the prompt
    assert max(short[1:]) < 30

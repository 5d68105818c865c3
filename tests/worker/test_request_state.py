"""The model runner's own state of each sequence (request_state.py) follows the step messages: new
sequences whole, cached ones' changes, forks, and drops on finished and preempted ids."""

from __future__ import annotations

import pytest

from pagellm.core.sched_output import (
    CachedSeqData,
    ForkedSeq,
    NewSeqData,
    ScheduledSeq,
    SchedulerOutput,
    TableEdit,
    apply_table_edit,
)
from pagellm.sampling_params import SamplingParams
from pagellm.worker.request_state import RequestStates

PARAMS = SamplingParams(temperature=0.5, seed=3)


def new(seq_id: int, prompt: list[int], table: list[int], groups: tuple[list[int], ...] = (),
        outputs: list[int] | None = None) -> NewSeqData:
    """A new sequence's message: ``table`` in the first KV cache group, ``groups`` the others' tables."""
    return NewSeqData(seq_id, prompt, outputs or [], PARAMS, 3, [table, *groups])


def test_a_new_sequence_is_taken_whole_and_owned():
    states = RequestStates()
    prompt, table, group = [1, 2, 3, 4, 5], [7, 8], [9, 10]
    message = new(1, prompt, table, (group,), outputs=[6])
    states.apply(SchedulerOutput(new_seqs=[message]))
    state = states[1]
    assert (state.prompt_token_ids, state.output_token_ids, state.block_tables) == (prompt, [6], [[7, 8], [9, 10]])
    assert state.params is PARAMS and state.seed == 3 and state.num_tokens == 6
    assert state.token_slice(4, 6) == [5, 6] and state.token_slice(5, 6) == [6]
    # The runner's tables and outputs are its own: later edits do not touch the message's lists.
    states.apply(SchedulerOutput(cached_seqs=[CachedSeqData(1, [11], [TableEdit(2, [12]), TableEdit(1, [13])])]))
    assert message.output_token_ids == [6] and table == [7, 8] and group == [9, 10]
    assert (state.output_token_ids, state.block_tables) == ([6, 11], [[7, 8, 12], [9, 13]])


def test_cached_changes_append_tokens_and_edit_tables():
    states = RequestStates()
    states.apply(SchedulerOutput(new_seqs=[new(1, [1, 2, 3], [4, 5, 6, 7])]))
    # Blocks 0 and 1 left the window, block 3 was copied on write (to 9) and block 10 appended.
    states.apply(SchedulerOutput(cached_seqs=[CachedSeqData(1, [20, 21], [TableEdit(3, [9, 10], 0, 2)])]))
    assert states[1].block_tables == [[0, 0, 6, 9, 10]] and states[1].output_token_ids == [20, 21]
    states.apply(SchedulerOutput(cached_seqs=[CachedSeqData(1, [22])]))  # a decode inside its last block
    assert states[1].block_tables == [[0, 0, 6, 9, 10]] and states[1].output_token_ids == [20, 21, 22]


def test_apply_table_edit_replaces_a_table_whole():
    table = [1, 2, 3]
    apply_table_edit(table, TableEdit(0, [0, 5, 6], 0, 1))
    assert table == [0, 5, 6]


def test_finished_and_preempted_sequences_are_dropped_and_a_new_one_replaces_stale_state():
    states = RequestStates()
    states.apply(SchedulerOutput(new_seqs=[new(1, [1], [1]), new(2, [2], [2]), new(3, [3], [3])]))
    states.apply(SchedulerOutput(finished_seq_ids=[1], preempted_seq_ids=[2]))
    assert 1 not in states and 2 not in states and len(states) == 1
    # A preempted sequence comes back whole, with what it generated; one sent whole again replaces.
    states.apply(SchedulerOutput(preempted_seq_ids=[3], new_seqs=[new(2, [2], [8], outputs=[5]), new(3, [3], [9])]))
    assert (states[2].output_token_ids, states[2].block_tables, states[3].block_tables) == ([5], [[8]], [[9]])
    with pytest.raises(KeyError):  # a change to a sequence the runner does not hold is a bug upstream
        states.apply(SchedulerOutput(cached_seqs=[CachedSeqData(1, [4])]))


def test_forked_children_copy_their_parent_with_their_own_seed():
    states = RequestStates()
    item = ScheduledSeq(1, 0, 3, sample=True, fork_children=[ForkedSeq(2, 21), ForkedSeq(3, 31)])
    states.apply(SchedulerOutput([item], new_seqs=[new(1, [1, 2, 3], [4], ([5],))]))
    parent = states[1]
    for seq_id, seed in ((2, 21), (3, 31)):
        child = states[seq_id]
        assert child.prompt_token_ids is parent.prompt_token_ids and child.params is PARAMS and child.seed == seed
        assert (child.output_token_ids, child.block_tables) == ([], [[], []])
    # Next step: each child's first token and its tables, whole.
    states.apply(SchedulerOutput(cached_seqs=[CachedSeqData(2, [7], [TableEdit(0, [4]), TableEdit(0, [6])])]))
    assert (states[2].output_token_ids, states[2].block_tables) == ([7], [[4], [6]])
    assert parent.output_token_ids == []


def test_a_workers_state_holds_no_sampling_parameters():
    states = RequestStates()
    states.apply(SchedulerOutput(new_seqs=[NewSeqData(1, [1], [], None, None, [[1]])]))
    with pytest.raises(RuntimeError, match="no sampling parameters"):
        _ = states[1].params

"""Draft slots in the scheduler (no model): reservation, rollback of rejected drafts, block
release, prefix-cache registration of verified tokens only, stops inside an accepted run."""

from __future__ import annotations

from deepinfer.sequence import FinishReason
from tests.engine.helpers import ROOT, make_scheduler, request, run_step


def decoding(s, prompt, max_tokens=16):
    """Admit a request and run its prefill: it then decodes its first sampled token (7)."""
    req = request(prompt, max_tokens=max_tokens)
    seq = s.add_request(req, ROOT)
    run_step(s)
    assert seq.num_tokens - seq.num_computed_tokens == 1
    return seq


def test_draft_slots_are_reserved_and_rejected_ones_rolled_back():
    s = make_scheduler(num_blocks=16, block_size=4)
    seq = decoding(s, [1, 2, 3, 4, 5, 6])  # 7 tokens, 6 computed, 2 blocks
    plan = s.schedule({seq.seq_id: 3})
    (item,) = plan.scheduled
    assert (item.num_new_tokens, item.num_draft_tokens, item.start, item.sample) == (4, 3, 6, True)
    assert len(seq.block_table) == 3  # positions 6..9
    free_before = s.kv.num_free_blocks
    s.update(plan, {seq.seq_id: [8, 9]})  # draft 1 accepted, draft 2 rejected and corrected to 9
    assert seq.token_ids[-3:] == [7, 8, 9]
    assert seq.num_computed_tokens == 8  # positions 6 (token 7) and 7 (accepted draft 8)
    assert len(seq.block_table) == 2 and s.kv.num_free_blocks == free_before + 1
    assert seq.num_registered == [2]  # positions 0..7 are all verified


def test_blocks_with_unverified_tokens_are_never_registered():
    s = make_scheduler(num_blocks=16, block_size=4)
    seq = decoding(s, [1, 2, 3, 4, 5, 6])
    plan = s.schedule({seq.seq_id: 3})
    s.update(plan, {seq.seq_id: [9]})  # every draft rejected
    # Position 7 holds the rejected draft's KV: block 1 (positions 4..7) must not be indexed.
    assert seq.num_computed_tokens == 7 and seq.num_tokens == 8
    assert seq.num_registered == [1] and s.kv.groups[0].pool.num_cached == 1
    plan = s.schedule({seq.seq_id: 2})
    assert plan.scheduled[0].start == 7  # the rejected slot is computed again, with the real token
    s.update(plan, {seq.seq_id: [10, 11, 12]})
    assert seq.num_computed_tokens == 10 and s.kv.groups[0].pool.num_cached == 2


def test_stop_token_inside_an_accepted_run_discards_the_rest():
    s = make_scheduler(num_blocks=16, block_size=4)
    seq = decoding(s, [1, 2, 3])
    plan = s.schedule({seq.seq_id: 3})
    updates = s.update(plan, {seq.seq_id: [5, 0, 6, 8]})  # EOS (0) accepted as draft 2
    assert updates[0].new_token_ids == [5, 0] and updates[0].finished
    assert seq.finish_reason == FinishReason.STOP and seq.output_token_ids == [7, 5, 0]
    assert s.kv.num_used_blocks == 0


def test_max_tokens_bounds_the_drafts_and_ends_a_run():
    s = make_scheduler(num_blocks=16, block_size=4)
    seq = decoding(s, [1, 2, 3], max_tokens=3)  # one output token so far
    plan = s.schedule({seq.seq_id: 5})
    assert plan.scheduled[0].num_draft_tokens == 1  # 2 tokens left: one draft plus the sampled one
    updates = s.update(plan, {seq.seq_id: [5, 6]})
    assert updates[0].finished and seq.finish_reason == FinishReason.LENGTH
    assert seq.output_token_ids == [7, 5, 6]


def test_context_length_bounds_the_drafts():
    s = make_scheduler(num_blocks=16, block_size=4, max_model_len=8)
    seq = decoding(s, [1, 2, 3, 4, 5])  # 6 tokens: positions 5..7 remain
    assert s.schedule({seq.seq_id: 5}).scheduled[0].num_draft_tokens == 2


def test_drafts_never_take_room_other_sequences_need():
    """Two decoding sequences, each about to open a new block, and two free blocks: the first one's
    drafts must stay within its new block rather than preempt the second; nor may they take the
    token budget the second needs."""
    s = make_scheduler(num_blocks=4, block_size=4, prefix=False)
    a = decoding(s, [1, 2, 3])  # decodes once more while b prefills: 5 tokens, 4 computed
    b = decoding(s, [5, 6, 7, 8])  # 5 tokens, 4 computed
    assert s.kv.num_free_blocks == 2
    plan = s.schedule({a.seq_id: 4, b.seq_id: 4})
    assert plan.preempted == []
    assert [item.num_draft_tokens for item in plan.scheduled] == [3, 3]  # positions 4..7: one block each
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    a, b = decoding(s, [1, 2]), decoding(s, [3, 4])
    plan = s.schedule({a.seq_id: 4})
    assert [(i.seq.seq_id, i.num_new_tokens) for i in plan.scheduled] == [(a.seq_id, 3), (b.seq_id, 1)]


def test_prefill_sequences_never_get_drafts():
    s = make_scheduler(num_blocks=16, block_size=4)
    seq = s.add_request(request([1, 2, 3, 4, 5]), ROOT)
    plan = s.schedule({seq.seq_id: 3})
    assert plan.scheduled[0].num_draft_tokens == 0 and plan.scheduled[0].num_new_tokens == 5


def test_truncated_drafts_release_their_slots():
    s = make_scheduler(num_blocks=16, block_size=4)
    seq = decoding(s, [1, 2, 3, 4, 5, 6])
    plan = s.schedule({seq.seq_id: 4})  # positions 6..10: 3 blocks
    (item,) = plan.scheduled
    item.truncate_drafts(0)  # the proposer had nothing to offer
    assert (item.num_new_tokens, item.num_draft_tokens, seq.num_computed_tokens) == (1, 0, 7)
    s.update(plan, {seq.seq_id: [8]})
    assert seq.num_computed_tokens == 7 and len(seq.block_table) == 2

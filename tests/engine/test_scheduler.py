"""Scheduler alone (no model): budgets, chunking, mixed steps, preemption, priority, abort, forks."""

from __future__ import annotations

from deepinfer.sequence import FinishReason, SequenceStatus

from .helpers import ROOT, make_scheduler, request, run_step


def shape(plan):
    return [(item.seq.request_id, item.num_new_tokens, item.sample) for item in plan.scheduled]


def test_chunked_prefill_then_decode_in_mixed_steps():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    a = request(list(range(1, 11)), max_tokens=3)
    b = request(list(range(20, 26)), max_tokens=3)
    s.add_request(a, ROOT)
    s.add_request(b, ROOT)
    plan, _ = run_step(s)
    assert shape(plan) == [(a.request_id, 8, False)]  # a's first chunk fills the budget
    plan, _ = run_step(s)
    assert shape(plan) == [(a.request_id, 2, True), (b.request_id, 6, True)]
    plan, _ = run_step(s)
    assert shape(plan) == [(a.request_id, 1, True), (b.request_id, 1, True)]  # both decoding


def test_prefill_chunk_size_caps_each_sequence():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=64, prefill_chunk_size=4)
    a = request(list(range(1, 11)))
    s.add_request(a, ROOT)
    sizes = [plan.scheduled[0].num_new_tokens for plan, _ in (run_step(s) for _ in range(3))]
    assert sizes == [4, 4, 2]


def test_decodes_are_not_starved_by_a_long_prefill():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    a = request([1, 2, 3], max_tokens=10)
    s.add_request(a, ROOT)
    run_step(s)
    b = request(list(range(100, 140)), max_tokens=2)
    s.add_request(b, ROOT)
    plan, _ = run_step(s)
    assert shape(plan) == [(a.request_id, 1, True), (b.request_id, 15, False)]


def test_max_num_seqs_limits_admission():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2)
    reqs = [request([i + 1, i + 2]) for i in range(3)]
    for r in reqs:
        s.add_request(r, ROOT)
    plan, _ = run_step(s)
    assert [item.seq.request_id for item in plan.scheduled] == [reqs[0].request_id, reqs[1].request_id]


def test_preemption_picks_latest_arrival_and_frees_its_blocks():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, prefix=False)
    a = request([1, 2, 3, 4], max_tokens=8, arrival=1.0)
    b = request([5, 6, 7, 8], max_tokens=8, arrival=2.0)
    s.add_request(a, ROOT)
    s.add_request(b, ROOT)
    run_step(s)  # both prefilled: 1 block each, plus their first sampled tokens
    for _ in range(8):  # grow until the 4 blocks are exhausted
        plan, _ = run_step(s)
        if plan.preempted:
            break
    assert [seq.request_id for seq in plan.preempted] == [b.request_id]
    b_seq = s.sequences_of(b.request_id)[0]
    assert (
        b_seq.status == SequenceStatus.WAITING and b_seq.block_table == [] and b_seq.num_computed_tokens == 0
    )
    assert s.kv.num_used_blocks <= 4


def test_priority_policy_preempts_lowest_priority_first():
    s = make_scheduler(
        num_blocks=4, block_size=4, max_num_batched_tokens=64, prefix=False, scheduling_policy="priority"
    )
    urgent = request([1, 2, 3, 4], max_tokens=8, priority=0, arrival=2.0)
    background = request([5, 6, 7, 8], max_tokens=8, priority=5, arrival=1.0)
    s.add_request(background, ROOT)
    s.add_request(urgent, ROOT)
    plan, _ = run_step(s)
    assert plan.scheduled[0].seq.request_id == urgent.request_id  # priority beats arrival
    for _ in range(8):
        plan, _ = run_step(s)
        if plan.preempted:
            break
    assert [seq.request_id for seq in plan.preempted] == [background.request_id]


def test_abort_any_time_frees_everything():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    a = request(list(range(1, 11)))
    b = request([1, 2])
    s.add_request(a, ROOT)
    s.add_request(b, ROOT)
    run_step(s)  # a is mid-prefill, b still waiting
    s.abort_request(b.request_id)
    s.abort_request(a.request_id)
    assert s.kv.num_used_blocks == 0
    assert not s.has_work() and s.num_unfinished_requests == 0
    assert s.abort_request("unknown") == []


def test_finish_on_eos_and_max_tokens():
    s = make_scheduler()
    a = request([1, 2, 3], max_tokens=2)
    s.add_request(a, ROOT)
    _, updates = run_step(s, token=9)
    _, updates = run_step(s, token=9)
    assert updates[0].finished and updates[0].seq.finish_reason == FinishReason.LENGTH
    b = request([1, 2, 3], max_tokens=5)
    s.add_request(b, ROOT)
    _, updates = run_step(s, token=0)  # 0 is EOS in these requests
    assert updates[0].finished and updates[0].seq.finish_reason == FinishReason.STOP
    assert s.kv.num_used_blocks == 0


def test_n_greater_than_one_forks_after_prefill_and_shares_prompt_blocks():
    s = make_scheduler(num_blocks=16, block_size=4)
    r = request(list(range(1, 11)), max_tokens=4, n=3)
    s.add_request(r, ROOT)
    plan, updates = run_step(s)
    assert len(plan.scheduled) == 1 and len(plan.scheduled[0].forks) == 2
    seqs = s.sequences_of(r.request_id)
    assert [seq.index for seq in seqs] == [0, 1, 2]
    assert seqs[1].block_table[:2] == seqs[0].block_table[:2]  # full prompt blocks shared
    assert len(updates) == 3
    plan, _ = run_step(s)
    assert len(plan.block_copies) >= 2  # the shared partial block is copied on write
    tails = {seq.block_table[-1] for seq in seqs}
    assert len(tails) == 3


def _turns_after_a_cached_prefix(**config):
    """Two new turns, 160 tokens each after a cached 2,048-token prefix, arriving together."""
    s = make_scheduler(num_blocks=256, block_size=16, **config)
    prefix = [(i % 900) + 1 for i in range(2048)]
    s.add_request(request([*prefix, 5], max_tokens=1), ROOT)
    while s.has_work():
        run_step(s)
    turns = [request([*prefix, *range(1000 + 200 * k, 1160 + 200 * k)], max_tokens=4) for k in range(2)]
    for r in turns:
        s.add_request(r, ROOT)
    return s, turns


def test_suffixes_after_a_long_cached_prefix_take_one_step_each():
    # Each attends ~2k positions per token, so together they would make both wait for both.
    s, (b, c) = _turns_after_a_cached_prefix()
    plan, _ = run_step(s)
    assert shape(plan) == [(b.request_id, 160, True)]
    assert plan.scheduled[0].start == 2048  # the prefix was a hit
    plan, _ = run_step(s)
    assert shape(plan) == [(b.request_id, 1, True), (c.request_id, 160, True)]


def test_without_an_attention_cap_the_suffixes_share_a_step():
    s, (b, c) = _turns_after_a_cached_prefix(max_prefill_attention=None)
    plan, _ = run_step(s)
    assert shape(plan) == [(b.request_id, 160, True), (c.request_id, 160, True)]


def test_a_deferred_running_prefill_goes_first_next_step():
    # Chunked prompts stay running between chunks; beside the first, a chunk must fit the cap.
    s = make_scheduler(
        num_blocks=64,
        block_size=4,
        max_num_batched_tokens=64,
        prefill_chunk_size=8,
        max_prefill_attention=100,
    )
    a, b = request(list(range(1, 17))), request(list(range(20, 36)))
    s.add_request(a, ROOT)
    s.add_request(b, ROOT)
    plan, _ = run_step(s)
    assert shape(plan) == [(a.request_id, 8, False), (b.request_id, 8, False)]  # 36 + 36 positions
    plan, _ = run_step(s)
    assert shape(plan) == [(a.request_id, 8, True)]  # b's chunk would attend 100 more
    plan, _ = run_step(s)
    assert shape(plan) == [(a.request_id, 1, True), (b.request_id, 8, True)]

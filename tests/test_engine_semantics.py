"""Pins of vLLM V1 scheduler and KV-cache semantics (shared/reference/vllm-engine-semantics.md §9.4)."""

from __future__ import annotations

import pytest

from enginekit import make_engine, req, run_steps


def test_fully_cached_32_token_prompt_hits_16_and_33_hits_32():
    e = make_engine()
    ids32 = list(range(1000, 1032))
    a = req("a", ids32, out=1)
    e.add(a)
    run_steps(e, 5)
    assert a.finished_reason == "length"
    b = req("b", ids32, out=1)
    e.add(b)
    e.schedule(10.0)
    assert b.num_cached_tokens == 16  # num_tokens - 1 cap: recompute one whole block
    e2 = make_engine()
    ids33 = list(range(1000, 1033))
    e2.add(req("a", ids33, out=1))
    run_steps(e2, 5)
    c = req("c", ids33, out=1)
    e2.add(c)
    e2.schedule(10.0)
    assert c.num_cached_tokens == 32


def test_kv_usage_unchanged_by_warm_idle_cache():
    e = make_engine(num_gpu_blocks=101)
    assert e.kv.usage() == 0.0
    e.add(req("a", 160, out=2))
    run_steps(e, 5)
    assert not e.running
    assert e.kv.usage() == 0.0  # the cached blocks are free (evictable)
    assert len(e.kv.materialise()) == 10


def test_preemption_victim_is_last_admitted_and_no_admission_that_step():
    # 11 usable blocks of 16; three requests of 48 tokens (3 blocks each) decode until blocks run out.
    e = make_engine(num_gpu_blocks=12, max_num_batched_tokens=512)
    a, b, c = req("a", 48, out=40), req("b", 48, out=40), req("c", 48, out=40)
    for r in (a, b, c):
        e.add(r)
    late = req("late", 16, out=2)
    t = 0.0
    while True:
        s = e.schedule(t)
        t += 1
        if s.preempted:
            break
        if t == 3:
            e.add(late)
        e.complete(s, t)
    assert s.preempted == [c]  # the most recently admitted
    assert late not in s.reqs and not s.admitted  # Phase B is skipped in a step that preempted
    assert e.waiting.peek() is c  # back at the head of the queue
    assert c.num_computed == 0 and c.num_preemptions == 1


def test_resumed_request_hits_are_not_counted_in_prefix_cache_metrics():
    e = make_engine(num_gpu_blocks=12, max_num_batched_tokens=512)
    rs = [req(x, 48, out=40) for x in "abc"]
    for r in rs:
        e.add(r)
    t = 0.0
    while e.num_preemptions == 0:
        s = e.schedule(t)
        t += 1
        e.complete(s, t)
    q, h = e.prefix_cache_queries, e.prefix_cache_hits
    assert q == 3 * 48 and h == 0
    while e.has_work:
        s = e.schedule(t)
        t += 1
        e.complete(s, t)
    assert rs[2].num_preemptions >= 1
    assert (e.prefix_cache_queries, e.prefix_cache_hits) == (q, h)
    e.kv.check_invariants()
    assert e.kv.num_free == e.kv.num_usable


def test_full_isl_check_blocks_head_and_fcfs_does_not_skip_to_smaller():
    e = make_engine(num_gpu_blocks=21, max_num_batched_tokens=64)  # 20 usable blocks
    big_running = req("run", 160, out=100)  # 10 blocks
    e.add(big_running)
    run_steps(e, 4)
    head = req("head", 320, out=2)  # needs 20 blocks for its whole sequence: does not fit now
    small = req("small", 16, out=2)  # would fit
    e.add(head)
    e.add(small)
    s = e.schedule(10.0)
    assert s.reqs == [big_running]
    assert head in e.waiting.items() and small in e.waiting.items()


def test_long_prefill_threshold_ignored_with_single_request():
    e = make_engine(long_prefill_token_threshold=100, max_num_batched_tokens=1000)
    r = req("solo", 900, out=1)
    e.add(r)
    s = e.schedule(0.0)
    assert s.ns == [900]
    e2 = make_engine(long_prefill_token_threshold=100, max_num_batched_tokens=1000)
    e2.add(req("x", 900, out=1))
    e2.add(req("y", 900, out=1))
    s2 = e2.schedule(0.0)
    assert s2.ns == [100, 100]


def test_decoders_after_a_big_chunk_get_no_token_when_budget_exhausted():
    e = make_engine(max_num_batched_tokens=256)
    big = req("big", 2000, out=2)
    e.add(big)
    d1, d2 = req("d1", 10, out=50), req("d2", 10, out=50)
    e.add(d1)
    e.add(d2)
    s = e.schedule(0.0)
    assert s.reqs == [big] and s.ns == [256]  # the big prompt takes the whole budget; others wait
    e.complete(s, 1.0)
    s = e.schedule(1.0)
    assert s.reqs == [big]  # running order: big is first and still prefilling


def test_chunked_prefill_worked_example():
    """§2.7: 100 decoders + a 20,000-token prompt at budget 8192: chunks 8092, 8092, 3816."""
    e = make_engine(num_gpu_blocks=5000, max_num_batched_tokens=8192, max_num_seqs=256)
    decs = [req(f"d{i}", 20, out=1000) for i in range(100)]
    for d in decs:
        e.add(d)
    run_steps(e, 1)
    big = req("big", 20_000, out=5)
    e.add(big)
    chunks = []
    t = 1.0
    for _ in range(3):
        s = e.schedule(t)
        t += 1
        chunks.append(s.ns[s.reqs.index(big)])
        assert sum(1 for r, n in zip(s.reqs, s.ns) if r is not big and n == 1) == 100
        e.complete(s, t)
    assert chunks == [8092, 8092, 3816]
    assert big.num_output == 1 and big.first_token_s == t


def test_chunked_prefill_off_is_head_of_line():
    e = make_engine(enable_chunked_prefill=False, max_num_batched_tokens=32768, max_model_len=32768, num_gpu_blocks=5000)
    e.add(req("a", 30000, out=1))
    e.add(req("b", 5000, out=1))
    s = e.schedule(0.0)
    assert [r.request_id for r in s.reqs] == ["a"]  # b does not fit the remaining 2768 tokens


def test_freed_blocks_go_tail_if_hashed_and_head_if_not():
    e = make_engine(num_gpu_blocks=11)
    r = req("a", 40, out=1)  # blocks: 2 full (hashed) + 1 partial
    e.add(r)
    s = e.schedule(0.0)
    held = list(r.blocks)
    e.complete(s, 1.0)
    order = e.kv.free_order()
    assert order[0] == held[2]  # unhashed partial block is reused first
    assert order[-2:] == [held[1], held[0]]  # hashed blocks at the tail, tail block first


def test_priority_policy_serves_low_value_first_and_preempts_lowest_priority():
    e = make_engine(policy="priority", num_gpu_blocks=12, max_num_batched_tokens=512)
    lo = req("lo", 48, out=60, priority=5, arrival=0.0)
    hi = req("hi", 48, out=60, priority=0, arrival=1.0)
    e.add(lo)
    e.add(hi)
    s = e.schedule(0.0)
    assert [r.request_id for r in s.reqs] == ["hi", "lo"]
    e.complete(s, 1.0)
    mid = req("mid", 48, out=60, priority=1, arrival=2.0)
    e.add(mid)
    t = 1.0
    while e.num_preemptions == 0:
        s = e.schedule(t)
        t += 1
        e.complete(s, t)
    assert lo.num_preemptions == 1 and hi.num_preemptions == 0 and mid.num_preemptions == 0


@pytest.mark.parametrize("caching", [True, False])
def test_drain_frees_every_block(caching):
    e = make_engine(num_gpu_blocks=40, max_num_batched_tokens=128, enable_prefix_caching=caching)
    for i in range(12):
        e.add(req(f"r{i}", 30 + 7 * i, out=20 + i))
    run_steps(e, 10_000)
    assert not e.has_work
    e.kv.check_invariants()
    assert e.kv.num_free == e.kv.num_usable

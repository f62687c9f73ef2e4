"""How a production router uses twin.policies: the same policy the twin simulated, fed real signals.

Run it: ``python docs/examples/production_router.py``. No network: the vLLM ``/metrics`` scrapes are
literal exposition texts below; a real router would GET ``http://<replica>/metrics`` every second or so.
"""

from __future__ import annotations

import yaml

from twin.policies import ReplicaSnapshot, RequestFacts, build_router
from twin.policies.prng import combine_hashes

# 1. The policy section of the scenario file the twin was run with (validated by the same pydantic models).
SCENARIO_POLICY_SECTION = """
router:
  kind: long_context_pool
  inner:
    kind: llm_d_scorer
    prefix_weight: 3.0
    queue_weight: 2.0
    kv_usage_weight: 2.0
"""

# 2. What each replica's vLLM /metrics endpoint returned at the last scrape (t = 100.0 s).
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SCRAPES = {
    "fleet.us-east.node01.r1": f"""
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.41
""",
    "fleet.us-east.node02.r1": f"""
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 14.0
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 1.0
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.47
""",
    "fleet.us-east.node03.r1": f"""
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 2.0
vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.08
""",
}
# What the router knows from its own service discovery: pool and context limit per replica.
INVENTORY = {
    "fleet.us-east.node01.r1": ("default", 32768),
    "fleet.us-east.node02.r1": ("default", 32768),
    "fleet.us-east.node03.r1": ("long_context", 131072),
}
BLOCK_SIZE_TOKENS = 16  # the engines' --block-size


def parse_exposition(text: str) -> dict[str, float]:
    """Metric name -> value from Prometheus text format (one engine per replica: labels are dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_and_labels, value = line.rsplit(" ", 1)
        out[name_and_labels.split("{", 1)[0]] = float(value)
    return out


def snapshot(replica_id: str, text: str, *, scraped_at_s: float, outstanding_tokens: int) -> ReplicaSnapshot:
    m = parse_exposition(text)
    pool, max_model_len = INVENTORY[replica_id]
    return ReplicaSnapshot(
        replica_id=replica_id, region="us-east", model=MODEL, pool=pool, healthy=True,
        num_running=int(m["vllm:num_requests_running"]), num_waiting=int(m["vllm:num_requests_waiting"]),
        kv_usage=m["vllm:kv_cache_usage_perc"], outstanding_tokens=outstanding_tokens,
        max_model_len=max_model_len, scraped_at_s=scraped_at_s,
    )


def block_hashes(token_ids: list[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks (the last partial block is not cacheable)."""
    out: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = combine_hashes((parent, *token_ids[start : start + block_size]))
        out.append(parent)
    return tuple(out)


def facts(request_id: str, token_ids: list[int], *, session_id: str, max_tokens: int) -> RequestFacts:
    return RequestFacts(
        request_id=request_id, tenant="acme", tier="paid", session_id=session_id, prompt_tokens=len(token_ids),
        expected_output_tokens=max_tokens, block_hashes=block_hashes(token_ids, BLOCK_SIZE_TOKENS), model=MODEL,
        region="us-east", allowed_regions=("us-east", "us-west"), needs_long_context=len(token_ids) > 32000,
    )


def main() -> None:
    section = yaml.safe_load(SCENARIO_POLICY_SECTION)
    router = build_router(section["router"], seed=20260101)
    outstanding = dict.fromkeys(SCRAPES, 0)  # the router's own ledger of tokens in flight per replica

    def snapshots() -> list[ReplicaSnapshot]:
        return [snapshot(r, t, scraped_at_s=100.0, outstanding_tokens=outstanding[r]) for r, t in SCRAPES.items()]

    system_prompt = list(range(1000, 1000 + 512))  # 32 blocks shared by every turn of the chat
    turn1 = facts("req-1", system_prompt + [7] * 40, session_id="chat-9", max_tokens=300)
    d1 = router.route(turn1, snapshots(), now_s=100.2)
    assert d1.replica_id is not None
    router.on_routed(turn1, d1.replica_id, now_s=100.2)
    outstanding[d1.replica_id] += turn1.total_tokens
    print(f"turn 1 -> {d1.replica_id}  ({d1.reason})")
    for rid, score in d1.scores:
        print(f"    {rid}: {score:.3f}")

    turn2 = facts("req-2", system_prompt + [7] * 40 + [9] * 200, session_id="chat-9", max_tokens=300)
    d2 = router.route(turn2, snapshots(), now_s=101.0)  # signals still from t = 100.0: stale by 1 s
    assert d2.replica_id == d1.replica_id, "the router remembers where it sent the shared prefix"
    router.on_routed(turn2, d2.replica_id, now_s=101.0)
    outstanding[d2.replica_id] += turn2.total_tokens
    print(f"turn 2 -> {d2.replica_id}  (same replica: prefix cached there)")

    # Both turns finish (the router sees the end of each stream) and the router updates its history.
    for req, rid, t in ((turn1, d1.replica_id, 104.0), (turn2, d2.replica_id, 107.5)):
        router.on_completed(req.request_id, rid, now_s=t)
        outstanding[rid] -= req.total_tokens

    long_doc = facts("req-3", list(range(40000)), session_id="doc-1", max_tokens=1000)
    d3 = router.route(long_doc, snapshots(), now_s=108.0)
    assert d3.replica_id == "fleet.us-east.node03.r1"
    print(f"long prompt -> {d3.replica_id}  ({d3.reason})")


if __name__ == "__main__":
    main()

"""The conversation service: history, prompt assembly inside a context budget, pinning, idempotent turns,
and asynchronous persistence of streamed tokens.

Durability (docs/consistency.md): a turn record is created when the gateway admits the turn; streamed
tokens are persisted in batches of ``persist_every_tokens`` after ``persist_latency_s``; the committed
response is durable ``persist_latency_s`` after the last token. A resume can recover only persisted
tokens. An idempotency key maps to one turn record; a retry of a completed turn returns the committed
response and never generates again; a retry while a generation is live attaches to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twin.fleet_config import ConversationConfig, TenantConfig
from twin.rng import stable_hash

_NO_HISTORY: list = []  # read only


@dataclass(slots=True)
class HistoryTurn:
    message_seg: int
    message_tokens: int
    answer_seg: int
    answer_tokens: int


@dataclass(slots=True)
class TurnRecord:
    key: str
    state: str = "in_progress"  # in_progress | completed | failed
    completions: int = 0  # generations that completed for this key (the invariant: <= 1)
    persisted_tokens: int = 0
    output_tokens: int = 0
    model: str = ""
    prompt_version: str = ""
    waiters: list = field(default_factory=list)  # events of attached retries


class ConversationService:
    def __init__(self, cfg: ConversationConfig) -> None:
        self.cfg = cfg
        self.history: dict[str, list[HistoryTurn]] = {}
        self.records: dict[str, TurnRecord] = {}
        self.duplicate_completions = 0
        self._head: dict[tuple[str, str, int, int], tuple[list[tuple[str, object]], int]] = {}

    # ---- idempotency -------------------------------------------------------------------------
    def begin(self, key: str) -> tuple[TurnRecord, bool]:
        """The record for ``key`` and whether this attempt should generate (False: reuse or attach)."""
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = TurnRecord(key=key)
            return rec, True
        if rec.state == "failed":
            rec.state = "in_progress"
            return rec, True
        return rec, False

    def complete(self, rec: TurnRecord, *, session_id: str, message_seg: int, message_tokens: int, answer_seg: int,
                 answer_tokens: int) -> None:
        rec.completions += 1
        if rec.completions > 1:
            self.duplicate_completions += 1
        rec.state = "completed"
        rec.output_tokens = answer_tokens
        self.history.setdefault(session_id, []).append(
            HistoryTurn(message_seg=message_seg, message_tokens=message_tokens, answer_seg=answer_seg,
                        answer_tokens=answer_tokens))

    def fail(self, rec: TurnRecord) -> None:
        if rec.state == "in_progress":
            rec.state = "failed"

    # ---- forgetting what no one will ask for again ----------------------------------------------
    # A fleet run simulates millions of turns: a record kept after its turn (~180 bytes with its waiter
    # list) and a history kept after its session (~110 bytes a turn, plus two segment hashes) were memory
    # no one read again. The client calls these when it is done with a key or a session: it never sends
    # that key or that session's turns again, so nothing observable changes.
    def end_turn(self, key: str) -> None:
        """The client will send no further attempt under ``key``: its record can go."""
        self.records.pop(key, None)

    def end_session(self, session_id: str) -> None:
        """The session has ended: no prompt will be assembled from its history again."""
        self.history.pop(session_id, None)

    # ---- prompt assembly ---------------------------------------------------------------------
    def assemble(self, *, session_id: str, tenant: TenantConfig, message_seg: int, message_tokens: int,
                 extra: list[tuple[int, int]] = ()) -> tuple[list[tuple[str, object]], int, int]:
        """Pieces of the prompt: system prompt + tools + history (oldest dropped over budget) + extra + message.

        Returns (pieces, prompt_tokens, history_turns_dropped).
        """
        head, n = self._tenant_head(tenant)
        if extra:
            tail: list[tuple[str, object]] = [("seg", e) for e in extra if e[1] > 0]
            tail.append(("seg", (message_seg, message_tokens)))
            n_tail = sum(e[1] for e in extra) + message_tokens
        else:  # most turns: the message alone
            tail = [("seg", (message_seg, message_tokens))]
            n_tail = message_tokens
        hist = self.history.get(session_id, _NO_HISTORY)
        budget = self.cfg.context_budget_tokens - n - n_tail
        keep: list[HistoryTurn] = []
        used = 0
        for h in reversed(hist):
            size = h.message_tokens + h.answer_tokens
            if used + size > budget:
                break
            keep.append(h)
            used += size
        keep.reverse()
        pieces = list(head)
        for h in keep:
            pieces.append(("seg", (h.message_seg, h.message_tokens)))
            pieces.append(("seg", (h.answer_seg, h.answer_tokens)))
        pieces.extend(tail)
        return pieces, n + used + n_tail, len(hist) - len(keep)

    def _tenant_head(self, tenant: TenantConfig) -> tuple[list[tuple[str, object]], int]:
        """The system prompt and tool pieces every prompt of ``tenant`` starts with, and their tokens
        (hashed once per tenant and prompt version, not per turn)."""
        key = (tenant.name, tenant.prompt_version, tenant.system_prompt_tokens, tenant.tools_tokens)
        got = self._head.get(key)
        if got is None:
            head: list[tuple[str, object]] = []
            n = 0
            if tenant.system_prompt_tokens:
                head.append(("seg", (stable_hash(f"system/{tenant.name}/{tenant.prompt_version}"),
                                     tenant.system_prompt_tokens)))
                n += tenant.system_prompt_tokens
            if tenant.tools_tokens:
                head.append(("seg", (stable_hash(f"tools/{tenant.name}/{tenant.prompt_version}"),
                                     tenant.tools_tokens)))
                n += tenant.tools_tokens
            got = self._head[key] = (head, n)
        return got

    def persisted(self, delivered_tokens: int) -> int:
        """Tokens durable once the batch holding them is written (batches of ``persist_every_tokens``)."""
        k = self.cfg.persist_every_tokens
        return (delivered_tokens // k) * k

"""The per-request state a replica engine carries (mirrors ``vllm/v1/request.py``)."""

from __future__ import annotations

from enum import IntEnum

from twin.models.tokens import TokenSeq


class Status(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class EngineRequest:
    """One request inside one replica.

    ``target_output_tokens`` is where the model would emit EOS (the workload draws it); ``max_tokens``
    caps it (``ignore_eos`` runs set both equal). ``num_computed`` advances optimistically at scheduling
    time, as in vLLM.
    """

    __slots__ = (
        "request_id", "arrival_s", "seq", "prompt_tokens", "max_tokens", "target_output_tokens",
        "priority", "num_computed", "_nout", "blocks", "num_cached_blocks", "status",
        "num_preemptions", "num_cached_tokens", "first_scheduled_s", "first_token_s", "last_token_s",
        "finish_s", "finished_reason", "token_times", "on_tokens", "on_finished", "tag", "watch_output", "group",
        "kv_preloaded", "adm", "g_ver", "g_base", "_grp", "kv_entry", "g_pl",
    )

    def __init__(
        self,
        *,
        request_id: str,
        arrival_s: float,
        seq: TokenSeq,
        max_tokens: int,
        target_output_tokens: int | None = None,
        priority: int = 0,
        record_token_times: bool = False,
        tag: object = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.seq = seq
        self.prompt_tokens = seq.num_tokens
        self.max_tokens = max_tokens
        self.target_output_tokens = max_tokens if target_output_tokens is None else min(target_output_tokens, max_tokens)
        self.priority = priority
        self.num_computed = 0
        self._nout = 0  # output tokens; read through ``num_output`` (a decode-group member's is an offset)
        self.blocks: list[int] = []
        self.num_cached_blocks = 0
        self.status = Status.WAITING
        self.num_preemptions = 0
        self.num_cached_tokens: int | None = None
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.finish_s: float | None = None
        self.finished_reason: str | None = None
        self.token_times: list[float] | None = [] if record_token_times else None
        self.on_tokens = None  # callback(req, n_new, t_s) at the first token and when num_output reaches watch_output
        self.on_finished = None  # optional callback(req)
        self.tag = tag
        self.group: str | None = None  # a label (e.g. tier) for per-group inter-token statistics
        self.watch_output: int | None = None  # a decode run stops when num_output reaches this (client hooks)
        self.kv_preloaded = 0  # tokens whose KV arrives by transfer (disaggregated decode), not computed here
        # Engine bookkeeping: admission number (running order), decode-group membership (see DecodeGroup)
        self.adm = 0
        self.g_ver: int | None = None
        self.g_base = 0
        self._grp = None
        self.g_pl = None  # the decode group's ``per`` list holding this member's next block touch, if any
        self.kv_entry = None  # the block pool's newest lazy registration of this request's blocks (kv_lazy._Lazy)

    @property
    def num_output(self) -> int:
        """Output tokens so far. For a member of the engine's decode group the stored count lags by the group
        steps completed since it was last written (``DecodeGroup``): the true count is read through here."""
        g = self._grp
        if g is None:
            return self._nout
        return self._nout + g.steps - self.g_base

    @num_output.setter
    def num_output(self, value: int) -> None:
        if self._grp is not None:
            raise RuntimeError("a decode-group member's output count is kept by its engine")
        self._nout = value

    @property
    def computed_now(self) -> int:
        """``num_computed`` read through the decode group's offset (the in-flight step's token included), for
        the block pool's deferred registration of a member's blocks (``BlockPool.pend``)."""
        g = self._grp
        if g is None:
            return self.num_computed
        return self.num_computed + g.steps - self.g_base + g.infl

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens (read through the decode group's offset like ``num_output``; a member's
        ``seq.num_tokens`` itself lags until the engine writes it)."""
        g = self._grp
        if g is None:
            return self.seq.num_tokens
        return self.seq.num_tokens + g.steps - self.g_base

    def remaining_steps(self, max_model_len: int) -> int:
        """Decode steps until this request stops (EOS/max_tokens or max_model_len)."""
        by_output = self.target_output_tokens - self.num_output
        by_len = max_model_len - self.num_tokens
        return min(by_output, by_len)

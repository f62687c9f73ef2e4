"""The engine-profile file format: one YAML file per (model, hardware, TP, dtypes) serving configuration.

Pydantic models, validated once at load time and frozen. Nothing here is on the simulator's hot path:
``EngineProfile.step_time_model()`` turns the coefficients into plain floats once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from twin.engine_profiles.memory import kv_bytes_per_token, weight_bytes
from twin.engine_profiles.step import StepShape
from twin.engine_profiles.step_time import LinearStepTimeModel
from twin.engine_settings import cpu_hardware

Dtype = Literal["bf16", "fp8", "fp32"]  # fp32: CPU profiles recorded so (twin record --dtype float32)

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp8": 1, "fp32": 4}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelShape(_Frozen):
    """A Llama-style dense decoder (GQA attention, gated SiLU MLP, RMSNorm)."""

    name: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    tie_word_embeddings: bool = False

    @model_validator(mode="after")
    def _gqa(self) -> ModelShape:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_kv_heads")
        return self


class Hardware(_Frozen):
    name: str
    gpu_memory_bytes: int = Field(gt=0, description="memory CUDA reports per device (torch.cuda.mem_get_info total)")
    gpus_per_node: int = Field(gt=0)
    price_per_gpu_hour_usd: float | None = Field(default=None, ge=0)


class MemoryAssumptions(_Frozen):
    """What vLLM's startup profiling subtracts besides weights (§3.3 of the engine-semantics reference)."""

    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)
    non_torch_bytes_per_gpu: int = Field(ge=0, description="NCCL / cuBLAS workspaces and other non-torch allocations")
    activation_bytes_per_batched_token: int = Field(
        ge=0, description="transient activation peak of the profiling pass, per max_num_batched_tokens token, per GPU"
    )
    cudagraph_bytes_per_gpu: int = Field(ge=0, description="CUDA-graph memory estimate subtracted at startup")
    notes: str = ""


class DecodeCoefficients(_Frozen):
    """Decode-only step: base_s + per_request_s * decode_requests + per_context_token_s * decode_context_tokens.

    Four optional terms (0 unless fitted on request, ``twin calibrate --decode-*``; left out of the file when 0, so
    a profile without them is the plain linear model): ``floor_requests``, a batch floor: the per-request term
    counts ``max(decode_requests, floor_requests)`` requests (a decode step of a few requests costs what one of
    ``floor_requests`` does: measured on the CPU runs, cause not traced; docs/calibration-sessions.md, "A batch floor");
    ``single_request_s`` when exactly one request decodes,
    ``per_context_token_sq_s * decode_context_tokens**2 / decode_requests`` (attention whose cost per token grows
    with each request's context), and ``batch_change_s``, added by replays (never the fleet simulation) to a
    decode-only step with fewer requests than the decode-only step before it (``decode_batch_changed``)."""

    base_s: float = Field(ge=0)
    per_request_s: float = Field(ge=0)
    per_context_token_s: float = Field(ge=0)
    floor_requests: int = Field(
        default=0, ge=0, description="batch floor: per_request_s counts max(decode_requests, floor_requests) requests "
                                     "(0 or 1: no floor)")
    single_request_s: float = Field(default=0.0, ge=0, description="extra when exactly one request decodes")
    per_context_token_sq_s: float = Field(
        default=0.0, ge=0, description="times decode_context_tokens**2 / decode_requests (squared context per request)")
    batch_change_s: float = Field(
        default=0.0, ge=0, description="extra on a decode-only step with fewer requests than the decode-only step "
                                       "before it (a request finished or was preempted; replays only)")
    shared_context_fraction: float = Field(
        default=1.0, ge=0, le=1, description="what a decode context token costs, as a fraction of the context terms, "
                                             "in a KV block that another decode item of the same step reads too "
                                             "(beyond the block's first reader: StepShape.decode_shared_tokens); "
                                             "replays only; 1 and left out of the file unless fitted "
                                             "(twin calibrate --server-shared-context)")

    @model_serializer(mode="wrap")
    def _leave_out_zero_terms(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = _without_zero(handler(self), ("floor_requests", "single_request_s", "per_context_token_sq_s",
                                             "batch_change_s"))
        if data.get("shared_context_fraction") == 1.0:
            data.pop("shared_context_fraction")
        return data


class PrefillCoefficients(_Frozen):
    """Prefill-carrying step: base_s + per_token_s * total_tokens + per_attention_pair_s * prefill_attention_pairs
    + per_decode_context_token_s * decode_context_tokens (never below the decode-only time of its decodes)."""

    base_s: float = Field(ge=0)
    per_token_s: float = Field(ge=0)
    per_attention_pair_s: float = Field(ge=0)
    per_decode_context_token_s: float = Field(ge=0)
    per_request_s: float = Field(
        default=0.0, ge=0, description="per request computed in the step (decode + prefill); fitted only on request "
                                       "(twin calibrate --prefill-per-request), else 0 and left out of the file")

    @model_serializer(mode="wrap")
    def _leave_out_zero_terms(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_zero(handler(self), ("per_request_s",))


class StepTimeCoefficients(_Frozen):
    overhead_s: float = Field(ge=0, description="per-step time outside model execution, added to every step")
    decode: DecodeCoefficients
    prefill: PrefillCoefficients
    first_step_s: float = Field(
        default=0.0, ge=0, description="extra time of the first step of a recorded run (a cold engine); applied by "
                                       "replays only, never by the fleet simulation; 0 and left out of the file "
                                       "unless fitted (twin calibrate --first-step)")

    @model_serializer(mode="wrap")
    def _leave_out_zero_terms(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_zero(handler(self), ("first_step_s",))


def _without_zero(data: dict[str, Any], optional: tuple[str, ...]) -> dict[str, Any]:
    """Optional terms added after profiles were shipped are written only when set, so a profile without them
    (every H100 profile) keeps its file byte for byte when regenerated."""
    for key in optional:
        if data.get(key) == 0.0:
            data.pop(key)
    return data


class PrefillPerRequestStepTime:
    """``LinearStepTimeModel`` plus the optional prefill ``per_request_s`` term (implements ``StepTimeModel``).

    A wrapper rather than a change to the hot-path model: profiles without the term (the H100 ones, the fleet's)
    get the plain ``LinearStepTimeModel``, untouched. The term goes inside the floor, as the other prefill terms:
    ``max(prefill + per_request * (decode + prefill requests), decode-only time of the same decodes)``.
    """

    __slots__ = ("base", "_mixed", "_per_request_s", "overhead_s")

    def __init__(self, coefficients: StepTimeCoefficients) -> None:
        self.base = LinearStepTimeModel.from_coefficients(coefficients)
        zero = DecodeCoefficients(base_s=0.0, per_request_s=0.0, per_context_token_s=0.0)
        # the prefill regime alone: with a zero decode regime its floor is the overhead, which it never goes below
        self._mixed = LinearStepTimeModel.from_coefficients(coefficients.model_copy(update={"decode": zero}))
        self._per_request_s = float(coefficients.prefill.per_request_s)
        self.overhead_s = self.base.overhead_s

    def step_time_s(self, shape: StepShape) -> float:
        if shape.prefill_requests == 0:
            return self.base.step_time_s(shape)
        mixed = self._mixed.step_time_s(shape) + self._per_request_s * (shape.decode_requests + shape.prefill_requests)
        decode = self.base.step_time_s(StepShape(decode_requests=shape.decode_requests,
                                                 decode_context_tokens=shape.decode_context_tokens))
        return mixed if mixed > decode else decode

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> Any:
        return self.base.decode_run_s(decode_requests, decode_context_tokens, num_steps)


class DecodeTermsStepTime:
    """A step-time model plus the optional stateless decode terms of ``DecodeCoefficients`` (``floor_requests``,
    ``single_request_s``, ``per_context_token_sq_s``); implements ``StepTimeModel``.

    A wrapper, as ``PrefillPerRequestStepTime``: profiles without the terms get the plain model, untouched. The terms
    are part of the decode-only time, so they also raise the floor of a prefill-carrying step (never faster than its
    decodes alone).
    """

    __slots__ = ("base", "_single_s", "_sq_s", "_floor", "_per_request_s", "overhead_s")

    def __init__(self, base: LinearStepTimeModel | PrefillPerRequestStepTime, decode: DecodeCoefficients) -> None:
        self.base = base
        self._single_s = float(decode.single_request_s)
        self._sq_s = float(decode.per_context_token_sq_s)
        self._floor = int(decode.floor_requests)
        self._per_request_s = float(decode.per_request_s)
        self.overhead_s = base.overhead_s

    def _fixed_s(self, n: int) -> float:
        """The terms that depend on the batch alone (the floor's requests not decoding, the single-request term)."""
        return ((self._single_s if n == 1 else 0.0)
                + (self._per_request_s * (self._floor - n) if n < self._floor else 0.0))

    def _extra_s(self, n: int, context: int) -> float:
        if n == 0:
            return 0.0
        return self._fixed_s(n) + self._sq_s * context * context / n

    def step_time_s(self, shape: StepShape) -> float:
        n, ctx = shape.decode_requests, shape.decode_context_tokens
        if shape.prefill_requests == 0:
            return self.base.step_time_s(shape) + self._extra_s(n, ctx)
        decode = self.base.step_time_s(StepShape(decode_requests=n, decode_context_tokens=ctx)) + self._extra_s(n, ctx)
        mixed = self.base.step_time_s(shape)
        return mixed if mixed > decode else decode

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> Any:
        n = decode_requests
        t = self.base.decode_run_s(n, decode_context_tokens, num_steps)
        if n == 0:
            return t
        context = (decode_context_tokens + n * np.arange(num_steps, dtype=np.int64)).astype(np.float64)
        return t + (self._fixed_s(n) + self._sq_s * context * context / n)


class SharedContextStepTime:
    """A step-time model whose decode context terms count a shared context token at ``fraction`` of an unshared
    one (``DecodeCoefficients.shared_context_fraction``); implements ``StepTimeModel``.

    A step's ``decode_shared_tokens`` are context tokens in KV blocks that another decode item of the same step
    reads too, beyond each block's first reader: requests that hit the same cached prefix read the same blocks. In
    the recorded CPU server runs such steps ran faster than their context says (docs/calibration-sessions.md, "Shared
    prefixes in decode steps"). The step is timed as the same step with ``(1 - fraction) * decode_shared_tokens``
    fewer context tokens, in every regime and term that reads the decode context. Only replays count the tokens
    (``twin.replay.SharedContextExtra``); a shape without them, and every decode run, is timed by the base model.
    """

    __slots__ = ("base", "fraction", "overhead_s")

    def __init__(self, base: Any, fraction: float) -> None:
        self.base = base
        self.fraction = float(fraction)
        self.overhead_s = base.overhead_s

    def step_time_s(self, shape: StepShape) -> float:
        shared = shape.decode_shared_tokens
        if shared:
            less = round((1.0 - self.fraction) * shared)
            shape = StepShape(shape.decode_requests, shape.decode_context_tokens - less, shape.prefill_requests,
                              shape.prefill_tokens, shape.prefill_attention_pairs)
        return self.base.step_time_s(shape)

    def decode_run_s(self, decode_requests: int, decode_context_tokens: int, num_steps: int) -> Any:
        return self.base.decode_run_s(decode_requests, decode_context_tokens, num_steps)


def decode_batch_changed(shapes: Sequence[StepShape]) -> np.ndarray:
    """Per step of a sequence (one replica's steps in order): True for a decode-only step that decodes fewer requests
    than the decode-only step before it (a request finished or was preempted in between). Where
    ``DecodeCoefficients.batch_change_s`` applies. (A decode step after a prefill-carrying one is not marked: in the
    recorded CPU runs it cost little extra in some runs and 1-2 ms in others; docs/calibration.md.)"""
    out = np.zeros(len(shapes), dtype=bool)
    prev: StepShape | None = None
    for i, s in enumerate(shapes):
        out[i] = (s.is_decode_only and prev is not None and prev.is_decode_only
                  and s.decode_requests < prev.decode_requests)
        prev = s
    return out


StepTimeOf = LinearStepTimeModel | PrefillPerRequestStepTime | DecodeTermsStepTime | SharedContextStepTime


def step_time_model_of(coefficients: StepTimeCoefficients) -> StepTimeOf:
    """The step-time model of ``coefficients``: the plain linear model unless an optional term is set (prefill
    ``per_request_s``; decode ``floor_requests`` / ``single_request_s`` / ``per_context_token_sq_s`` /
    ``shared_context_fraction``). ``first_step_s`` and decode ``batch_change_s`` are not part of it: they depend on a
    run's step sequence, and replays add them (``twin.replay``); the fleet simulation shares one model between
    replicas, so it could not."""
    model: LinearStepTimeModel | PrefillPerRequestStepTime | DecodeTermsStepTime = (
        PrefillPerRequestStepTime(coefficients) if coefficients.prefill.per_request_s
        else LinearStepTimeModel.from_coefficients(coefficients))
    d = coefficients.decode
    if d.single_request_s or d.per_context_token_sq_s or d.floor_requests > 1:
        model = DecodeTermsStepTime(model, d)
    if d.shared_context_fraction < 1.0:
        return SharedContextStepTime(model, d.shared_context_fraction)
    return model


class RegimeFitQuality(_Frozen):
    num_samples: int
    rmse_s: float
    mean_abs_rel_error: float
    max_abs_rel_error: float


class FitQuality(_Frozen):
    """How well the compact coefficients reproduce the points they were fitted to."""

    target: str = Field(description="what the compact model was fitted to")
    decode: RegimeFitQuality
    prefill: RegimeFitQuality


class Check(_Frozen):
    """One comparison of the profile against a public measured figure (not used in the fit unless used_in_fit)."""

    name: str
    source: str = Field(description="file path relative to ../shared (or to the repository, for files it holds)")
    quantity: str
    measured: float
    twin: float
    rel_error: float = Field(description="(twin - measured) / measured")
    twin_operator_level: float | None = Field(
        default=None, description="the same figure from the operator-level model the coefficients were fitted to"
    )
    used_in_fit: bool = False
    notes: str = ""


class Provenance(_Frozen):
    sources: list[str] = Field(
        description="file paths relative to ../shared (or to the repository, for files it holds)")
    command: str
    generated_on: str
    notes: str = ""


class StepTimeNoise(_Frozen):
    """Step-to-step variation of the step time around the fitted regimes (replays only; docs/calibration.md).

    ``decode`` / ``prefill`` are the percentiles 0, 1, ..., 100 of ``measured / fitted`` model-execution time over
    the calibration steps of that regime (trimmed outlier steps included). A replay multiplies each step's
    modelled model-execution time by a draw from that distribution (inverse CDF, linear between percentiles,
    seeded per run); the ratios are used as fitted, not re-centred (docs/calibration.md says why).
    """

    decode: list[float] = Field(min_length=101, max_length=101)
    prefill: list[float] = Field(min_length=101, max_length=101)
    num_samples: dict[str, int] = Field(description="calibration steps behind each regime's percentiles")
    notes: str = ""

    @model_validator(mode="after")
    def _sorted_positive(self) -> StepTimeNoise:
        for q in (self.decode, self.prefill):
            if q[0] < 0 or any(b < a for a, b in zip(q, q[1:])):
                raise ValueError("noise percentiles must be non-negative and non-decreasing")
        return self


class HostWitnessTerm(_Frozen):
    """How a recorded run's steps follow the host's speed, as the recorder's host witness measures it (replays of
    recorded runs only, and only when asked: ``twin fidelity --host-witness``; docs/calibration.md).

    Fitted by ``twin calibrate`` on the calibration runs that carry a witness: ``level = (witness / reference_ms) **
    exponent``, least squares in logs, where a run's level is the median recorded / modelled time of its decode steps
    and its witness the median sample of ``workload.host_witness`` (``_vllm_common.HostWitness``). A replay that uses
    it scales each step's modelled model-execution time by the run's own ``level``.
    """

    reference_ms: float = Field(gt=0, description="the witness's median at which the fitted model's level is 1")
    exponent: float = Field(description="d log(level) / d log(witness) over the calibration runs")
    runs: int = Field(ge=3, description="calibration runs behind the fit")
    correlation: float = Field(ge=-1, le=1, description="of log level and log witness over those runs")
    notes: str = ""


class ServerFrontEnd(_Frozen):
    """An engine behind vLLM's OpenAI API server (recorded runs with ``mode: server``; offline runs and the
    fleet simulation do not use it). Fitted by ``twin calibrate`` from server runs (docs/calibration.md)."""

    arrival_s: float = Field(ge=0, description="from the client's send until the request can be scheduled, "
                                                 "plus the last hop of a token back to the client")
    per_chunk_s: float = Field(ge=0, description="front-end time per streamed chunk (per request computed in a step)")
    step_time: StepTimeCoefficients = Field(
        description="server-mode step time; overhead_s is the per-step front-end base")
    fit_quality: FitQuality
    provenance: Provenance
    step_time_noise: StepTimeNoise | None = Field(default=None, description="server-mode step-time noise (replays)")
    idle_wake_s: float = Field(
        default=0.0, ge=0, description="extra time of the first step after the engine was idle for at least "
                                       "twin.calibration.server.IDLE_AFTER_S (a request sent to a quiet server); "
                                       "0 and left out of the file unless fitted (twin calibrate --idle-wake)")
    per_first_chunk_s: float = Field(
        default=0.0, ge=0, description="front-end time per stream opened in a step (a request's first token), "
                                       "beyond per_chunk_s; 0 and left out of the file unless fitted "
                                       "(twin calibrate --stream-ends)")
    per_last_chunk_s: float = Field(
        default=0.0, ge=0, description="front-end time per stream closed in a step (a request's last token), "
                                       "beyond per_chunk_s; 0 and left out of the file unless fitted "
                                       "(twin calibrate --stream-ends)")

    per_request_in_s: float = Field(
        default=0.0, ge=0, description="front-end time per request the client sends while a step runs (the API "
                                       "server taking it in: parse, tokenize, hand to the engine core), added to "
                                       "that step; 0 and left out of the file unless fitted (twin calibrate --intake)")

    per_request_in_step_s: float = Field(
        default=0.0, ge=0, description="engine step time per request the client sends while the step runs (the API "
                                       "server's intake slowing the engine on the cores they share), added to that "
                                       "step in profile replays (recorded steps hold it already); 0 and left out of "
                                       "the file unless fitted (twin calibrate --intake-step)")

    @property
    def has_stream_ends(self) -> bool:
        return bool(self.per_first_chunk_s or self.per_last_chunk_s)

    @model_serializer(mode="wrap")
    def _leave_out_zero_terms(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_zero(handler(self), ("idle_wake_s", "per_first_chunk_s", "per_last_chunk_s",
                                             "per_request_in_s", "per_request_in_step_s"))


class EngineProfileSpec(_Frozen):
    """The YAML file, field by field (see docs/profiles.md)."""

    name: str
    model: ModelShape
    hardware: Hardware
    tp: int = Field(gt=0)
    weight_dtype: Dtype
    kv_dtype: Dtype
    memory: MemoryAssumptions
    step_time: StepTimeCoefficients | None = Field(
        default=None, description="None for a shape-only skeleton whose coefficients are not fitted yet"
    )
    fit_quality: FitQuality | None = None
    checks: list[Check] = Field(default_factory=list)
    provenance: Provenance
    server: ServerFrontEnd | None = Field(default=None, description="only for replays of server-mode recordings")
    step_time_noise: StepTimeNoise | None = Field(
        default=None, description="fitted step-time noise, used by replays of recorded runs only (None: deterministic)")
    host_witness: HostWitnessTerm | None = Field(
        default=None, description="how the calibration runs' steps followed the host witness (replays on request)")

    @model_validator(mode="after")
    def _tp_divides_heads(self) -> EngineProfileSpec:
        if self.model.num_attention_heads % self.tp:
            raise ValueError(f"tp {self.tp} does not divide {self.model.num_attention_heads} attention heads")
        return self


class EngineProfile:
    """A loaded profile: the validated spec plus the derived quantities the twin needs."""

    __slots__ = ("spec", "_kv_bytes_per_token", "_weight_bytes")

    def __init__(self, spec: EngineProfileSpec) -> None:
        self.spec = spec
        self._kv_bytes_per_token = kv_bytes_per_token(
            num_layers=spec.model.num_layers,
            num_kv_heads=spec.model.num_kv_heads,
            head_dim=spec.model.head_dim,
            dtype_bytes=DTYPE_BYTES[spec.kv_dtype],
        )
        self._weight_bytes = weight_bytes(spec.model, weight_dtype_bytes=DTYPE_BYTES[spec.weight_dtype])

    name = property(lambda self: self.spec.name)
    model = property(lambda self: self.spec.model)
    hardware = property(lambda self: self.spec.hardware)
    tp = property(lambda self: self.spec.tp)
    weight_dtype = property(lambda self: self.spec.weight_dtype)
    kv_dtype = property(lambda self: self.spec.kv_dtype)
    memory = property(lambda self: self.spec.memory)

    @property
    def on_gpu(self) -> bool:
        """A GPU profile (``twin.engine_settings.cpu_hardware`` says no): vLLM resolves ``async_scheduling`` on."""
        return not cpu_hardware(self.spec.hardware.name)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token for the whole replica (all TP ranks together)."""
        return self._kv_bytes_per_token

    @property
    def weight_bytes(self) -> int:
        """Weight bytes for the whole replica (all TP ranks together)."""
        return self._weight_bytes

    def step_time_model(self) -> StepTimeOf:
        if self.spec.step_time is None:
            raise ValueError(
                f"profile {self.name!r} has no fitted step-time coefficients yet "
                "(fit them with twin.engine_profiles.fit.fit_step_time)"
            )
        return step_time_model_of(self.spec.step_time)

    def __repr__(self) -> str:
        return f"EngineProfile({self.name!r}, tp={self.tp}, weights={self.weight_dtype}, kv={self.kv_dtype})"

"""The user population: sessions arriving through a diurnal curve with surges, tiers, tenants and classes.

Sessions start as a non-homogeneous Poisson process (thinning against the peak rate). A session is one
user's conversation: a number of turns (geometric), think time between them (exponential), a tenant
(and so a tier, a system prompt and a residency), a home region (DNS steering by region share, inside
the tenant's residency), and a class. Every draw comes from a named stream.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from twin.fleet_config import LengthConfig, PopulationTraffic, TenantConfig, TopologyConfig
from twin.rng import stream

CLASSES = ("chat", "retrieval", "tool", "background", "long_context")


@dataclass(frozen=True, slots=True)
class SessionSpec:
    session_id: str
    user_id: str
    start_s: float
    tenant: TenantConfig
    region: str
    klass: str
    turns: int
    trace: object = None  # a RequestSpec when the session replays one trace request


def trace_sessions(traffic, topology: TopologyConfig, *, seed: int, replication: int) -> list[SessionSpec]:
    """One single-turn session per trace request, with a tenant and a home region drawn per request."""
    from twin.models.traces import trace_requests

    specs = trace_requests(traffic.trace, seed=seed, replication=replication)
    rng = stream(seed, replication, "workload.trace_sessions")
    tenants = traffic.tenants
    t_share = np.array([t.share for t in tenants], dtype=float)
    t_share = t_share / t_share.sum()
    out = []
    for i, r in enumerate(specs):
        tenant = tenants[int(rng.choice(len(tenants), p=t_share))]
        allowed = [g for g in topology.regions if tenant.residency is None or g.name in tenant.residency]
        w = np.array([g.share for g in allowed], dtype=float)
        w = w / w.sum() if w.sum() > 0 else np.full(len(allowed), 1.0 / len(allowed))
        region = allowed[int(rng.choice(len(allowed), p=w))].name
        out.append(SessionSpec(session_id=f"s{i:07d}", user_id=f"u{i:07d}", start_s=r.arrival_s, tenant=tenant,
                               region=region, klass="chat", turns=1, trace=r))
    return out


_KAPPA: dict[float, float] = {}
_I0: dict[float, float] = {}  # I0(k) per k: numpy's i0 costs microseconds and the world calls it per session


def _kappa(peak_factor: float) -> float:
    """k such that exp(k) / I0(k) = peak_factor (bisection; I0 from numpy)."""
    if peak_factor in _KAPPA:
        return _KAPPA[peak_factor]
    lo, hi = 0.0, 1.0
    while math.exp(hi) / float(np.i0(hi)) < peak_factor:
        hi *= 2.0
    for _ in range(80):
        mid = (lo + hi) / 2.0
        if math.exp(mid) / float(np.i0(mid)) < peak_factor:
            lo = mid
        else:
            hi = mid
    _KAPPA[peak_factor] = (lo + hi) / 2.0
    return _KAPPA[peak_factor]


def diurnal_shape(hour: float, peak_factor: float, peak_hour: float) -> float:
    """Rate relative to the daily mean: a von Mises curve over the day, mean 1, peak/mean = peak_factor."""
    if peak_factor <= 1.0:
        return 1.0
    k = _kappa(peak_factor)
    i0 = _I0.get(k)
    if i0 is None:
        i0 = _I0[k] = float(np.i0(k))
    return math.exp(k * math.cos(2.0 * math.pi * (hour - peak_hour) / 24.0)) / i0


def _one_surge(t_s: float, s) -> float:
    if t_s < s.start_s or t_s > s.start_s + s.ramp_s + s.hold_s:
        return 1.0
    ramp = 1.0 if s.ramp_s == 0 else min((t_s - s.start_s) / s.ramp_s, 1.0)
    return 1.0 + (s.multiplier - 1.0) * ramp


def tenant_weights(t_s: float, traffic: PopulationTraffic) -> list[float]:
    """Each tenant's share of traffic at ``t_s``, with its own surges applied (not normalised)."""
    out = []
    for tenant in traffic.tenants:
        w = tenant.share
        for s in traffic.surges:
            if s.tenant == tenant.name:
                w *= _one_surge(t_s, s)
        out.append(w)
    return out


def surge_factor(t_s: float, traffic: PopulationTraffic) -> float:
    """Whole-population surges times the extra traffic of tenant-specific surges."""
    f = 1.0
    for s in traffic.surges:
        if s.tenant is None:
            f *= _one_surge(t_s, s)
    if any(s.tenant is not None for s in traffic.surges):
        base = math.fsum(t.share for t in traffic.tenants)
        f *= math.fsum(tenant_weights(t_s, traffic)) / base if base > 0 else 1.0
    return f


def turn_rate_per_s(t_s: float, traffic: PopulationTraffic, scale: float = 1.0) -> float:
    """Turns per second at simulated time ``t_s`` (daily mean × diurnal shape × surges × scales)."""
    mean = traffic.daily_users * traffic.turns_per_user / 86_400.0
    hour = (traffic.start_hour + t_s / 3600.0) % 24.0
    return (mean * diurnal_shape(hour, traffic.diurnal.peak_factor, traffic.diurnal.peak_hour)
            * surge_factor(t_s, traffic) * traffic.scale * scale)


def draw_length(cfg: LengthConfig, rng: np.random.Generator) -> int:
    return LengthDraw(cfg)(rng)


class LengthDraw:
    """:func:`draw_length` for one config, with the lognormal's ``mu`` computed once (the same float):
    clients draw two lengths per turn."""

    __slots__ = ("mu", "sigma", "lo", "hi")

    def __init__(self, cfg: LengthConfig) -> None:
        self.mu = math.log(cfg.mean) - cfg.sigma**2 / 2.0
        self.sigma, self.lo, self.hi = cfg.sigma, cfg.min, cfg.max

    def __call__(self, rng: np.random.Generator) -> int:
        # rng.lognormal(mu, sigma), spelled as numpy computes it (exp(mu + sigma * z), z one standard normal
        # draw): the same float and the same stream position, without lognormal's per-call argument checks,
        # which cost more than the draw (tests/test_population_draws.py)
        return self.of_normal(rng.standard_normal())

    def of_normal(self, z: float) -> int:
        """The length for the standard normal draw ``z`` (what ``__call__`` does with its one draw)."""
        x = math.exp(self.mu + self.sigma * z)
        return int(min(max(round(x), self.lo), self.hi))


class IndexDraw:
    """``int(rng.choice(len(p), p=p))`` with the table built once.

    numpy's ``choice`` with ``p`` normalises ``p.cumsum()`` by its last value, draws one uniform and
    bisects to the right; this does the same arithmetic and the same single draw, so it returns the same
    index and leaves the stream in the same place, without numpy's per-call argument checks (they cost
    more than the draw, and the world draws three per session up front). A ``p`` numpy would refuse
    (empty, negative, not finite, zero sum) is left to numpy, which raises as before.
    """

    __slots__ = ("p", "cdf")

    def __init__(self, p: np.ndarray) -> None:
        self.p = p = np.asarray(p, dtype=float)
        self.cdf: list[float] | None = None
        if len(p) and bool(np.all(np.isfinite(p))) and bool(np.all(p >= 0)) and p.sum() > 0:
            cdf = p.cumsum()
            cdf /= cdf[-1]
            self.cdf = cdf.tolist()

    def __call__(self, rng: np.random.Generator) -> int:
        if self.cdf is None:
            return int(rng.choice(len(self.p), p=self.p))
        return bisect.bisect_right(self.cdf, rng.random())


def sessions(traffic: PopulationTraffic, topology: TopologyConfig, *, seed: int, replication: int,
             scale: float = 1.0) -> list[SessionSpec]:
    if traffic.kind == "trace_replay":
        return trace_sessions(traffic, topology, seed=seed, replication=replication)
    rng = stream(seed, replication, "workload.sessions")
    mean_turns = traffic.turns_per_session
    # session rate = turn rate / turns per session; thinning against an upper bound of the rate
    grid = np.linspace(0.0, traffic.duration_s, 1 + max(int(traffic.duration_s // 10), 1))
    peak = max(turn_rate_per_s(float(t), traffic, scale) for t in grid) * 1.05 / mean_turns
    for s in traffic.surges:
        peak = max(peak, turn_rate_per_s(s.start_s + s.ramp_s, traffic, scale) * 1.05 / mean_turns)
    tenants = traffic.tenants
    t_share = np.array([t.share for t in tenants], dtype=float)
    t_share = t_share / t_share.sum()
    cls = traffic.classes
    c_share = np.array([cls.chat, cls.retrieval, cls.tool, cls.background, cls.long_context], dtype=float)
    c_share = c_share / c_share.sum()
    regions = topology.regions
    has_tenant_surges = any(s.tenant is not None for s in traffic.surges)
    tenant_classes = {}
    for tn in tenants:
        if tn.classes is not None:
            c = tn.classes
            v = np.array([c.chat, c.retrieval, c.tool, c.background, c.long_context], dtype=float)
            tenant_classes[tn.name] = v / v.sum()
    # the draws' tables, built once per tenant (see IndexDraw)
    draw_tenant = IndexDraw(t_share)
    draw_class = [IndexDraw(tenant_classes.get(tn.name, c_share)) for tn in tenants]
    draw_region = []
    for tn in tenants:
        allowed = [r for r in regions if tn.residency is None or r.name in tn.residency]
        r_share = np.array([r.share for r in allowed], dtype=float)
        r_share = r_share / r_share.sum() if r_share.sum() > 0 else np.full(len(allowed), 1.0 / len(allowed))
        draw_region.append((allowed, IndexDraw(r_share)))
    out: list[SessionSpec] = []
    t = 0.0
    n = 0
    p_turns = 1.0 / mean_turns
    while True:
        t += rng.exponential(1.0 / peak)
        if t >= traffic.duration_s:
            break
        if rng.random() * peak > turn_rate_per_s(t, traffic, scale) / mean_turns:
            continue
        if has_tenant_surges:
            w = np.array(tenant_weights(t, traffic), dtype=float)
            i_tenant = int(rng.choice(len(tenants), p=w / w.sum()))
        else:
            i_tenant = draw_tenant(rng)
        tenant = tenants[i_tenant]
        allowed, draw_r = draw_region[i_tenant]
        region = allowed[draw_r(rng)].name
        klass = CLASSES[draw_class[i_tenant](rng)]
        turns = 1 if klass == "background" else int(rng.geometric(p_turns))
        out.append(SessionSpec(session_id=f"s{n:07d}", user_id=f"u{n:07d}", start_s=float(t), tenant=tenant,
                               region=region, klass=klass, turns=turns))
        n += 1
    return out

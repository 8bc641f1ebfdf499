"""Placement from routing statistics: per MoE layer, a static split or a cache, chosen from the measured picks and
lane rates, re-planned while serving (issue 32, "Placement that fits the routing").

The two plans of a layer, over the tiers a TieredExperts already has:
  static  the layer's GPU-resident experts stay as they are: nothing of it is promoted into a GPU slot, and its
          residents are not written back to make room for other layers'. What it picks elsewhere is read from
          the RAM tier (zero-copy: in place over PCIe; else copied, or computed on the CPU lane). This is
          llama.cpp's `--n-cpu-moe` kind of split: the preload fills the GPU slots in store order, whole layers
          first, and the rest lives in RAM.
  cache   the layer's experts follow its routing: the ones it reads from RAM are promoted into GPU slots, the
          coldest residents (of cache layers) written back (engine.tiers.zero_copy; the other paths' eviction
          policy likewise). Worth it only where a few experts take many of the picks.
Why not always a cache: under near-uniform routing a hot set does not exist, so every promotion is a PCIe copy
(and a write-back) that buys no hits, on the lane the RAM-tier reads themselves need (issue 32: 61-65 tok/s at a
6 GiB budget under uniform routing, 0.4x llama.cpp).

How a layer's plan is chosen (Planner.plan, every `every` picks of a layer):
- pick counts per expert, decayed by `decay` at each re-plan (a window of ~every/(1-decay) picks);
- skew = the share of the layer's picks on its hottest h experts minus h/E (what any h experts get under uniform
  routing), h = the layer's share of the GPU slots (slots / MoE layers), or E/8 where that is none or all — not
  the layer's residents now: those follow the plans themselves (a static layer keeps its preload, a prefill keeps
  the hot set), and a layer holding 12 of 16 experts cannot show more than 0.25 of skew at h = 12;
- noise = what that skew reaches under uniform routing with the window's picks: the expected excess of the top h
  of E equal counts (a sample's hottest are hot by chance) plus 3 standard deviations of a binomial share;
- the cache's gain per pick = skew x record_bytes / miss lane rate (the misses it saves, at the rate of the
  lane that serves a miss: PCIe or the CPU lane, whichever the rates make faster), against the churn a cache
  pays, the measured promotions per pick x record_bytes / PCIe rate;
- cache when skew > noise + ENTER and gain > churn; back to static only when skew < noise + LEAVE (LEAVE <
  ENTER: hysteresis) or the churn exceeds the gain by half again, so a layer near the edge does not flap.
Each change is one log line; the plan is in counters()["placement"] (and on /metrics: kiln_placement_*).
Where a plan acts: zero-copy decode's promotions and write-backs (engine.tiers.zero_copy) and the CPU lane's
promotions (TieredExperts._promote). The piecewise decode and prefill (TieredExperts._place, moe_forward's waves)
must copy a pick into a slot to compute it on the GPU, so there a static layer's residents can still be evicted by
the tiers' policy; only the promotions are held.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

log = logging.getLogger("engine.tiers")
_NORMAL = NormalDist()

PLANS = ("auto", "cache", "static")
EVERY = 2048             # picks of a layer between re-plans (256 tokens at top-8)
DECAY = 0.5              # counts kept at each re-plan
ENTER, LEAVE = 0.06, 0.03   # skew beyond the noise to become a cache / below which to stop being one
MIN_PICKS = 256          # a layer's (decayed) picks before it is planned at all


@dataclass
class LayerPlan:
    layer: int
    mode: str = "cache"          # cache until measured: the tiers' behaviour before planning existed
    skew: float = 0.0
    noise: float = 0.0
    gpu_experts: int = 0
    hot: int = 0
    miss_lane: str = "pcie"
    gain_s: float = 0.0          # seconds a pick the cache saves on the miss lane
    churn_s: float = 0.0         # seconds a pick its promotions cost on PCIe
    changes: int = 0

    def as_dict(self) -> dict:
        return {"mode": self.mode, "skew": round(self.skew, 4), "noise": round(self.noise, 4),
                "gpu_experts": self.gpu_experts, "hot": self.hot, "miss_lane": self.miss_lane,
                "gain_us_per_pick": round(self.gain_s * 1e6, 3), "churn_us_per_pick": round(self.churn_s * 1e6, 3),
                "changes": self.changes}


def skew_and_noise(counts: np.ndarray, hot: int) -> tuple[float, float]:
    """(share of the picks on the `hot` most-picked experts − hot/E, what that excess reaches under uniform
    routing with these many picks: the expected excess of the top `hot` of E equal Poisson counts (normal
    approximation: φ(z)·sqrt(E/n), z the upper hot/E quantile) plus 3 σ of a binomial share)."""
    e = counts.size
    n = float(counts.sum())
    if n <= 0 or not 0 < hot < e:
        return 0.0, 1.0
    share = float(np.sort(counts)[::-1][:hot].sum()) / n
    p = hot / e
    z = _NORMAL.inv_cdf(1 - p)
    return share - p, _NORMAL.pdf(z) * math.sqrt(e / n) + 3.0 * math.sqrt(p * (1 - p) / n)


class Planner:
    """The per-layer plans of one tiered provider. observe() is fed every routed pick (rows of expert ids per
    layer); tick(picks, resident, rates) re-plans once `every` picks of a layer have passed."""

    def __init__(self, layers: list[int], experts: int, record_bytes: int, *, mode: str = "auto",
                 every: int = EVERY, decay: float = DECAY, gpu_slots: int | None = None):
        if mode not in PLANS:
            raise ValueError(f"placement {mode!r} is not one of {', '.join(PLANS)}")
        self.layers, self.experts, self.record_bytes = list(layers), experts, record_bytes
        self.mode, self.every, self.decay = mode, every, decay
        self.share = round(gpu_slots / len(self.layers)) if gpu_slots and self.layers else None   # h, per layer
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.counts = np.zeros((len(self.layers), experts), dtype=np.float64)
        self.picks = 0                           # picks of a layer since the last plan
        self.promoted = np.zeros(len(self.layers), dtype=np.int64)    # promotions into GPU slots in the window
        self.plans = {layer: LayerPlan(layer, mode="static" if mode == "static" else "cache") for layer in self.layers}
        self.replans = 0
        self.changes = 0
        self._static = frozenset(layer for layer, p in self.plans.items() if p.mode == "static")

    # -- what the provider asks -------------------------------------------------------------------------
    def promotes(self, layer: int) -> bool:
        """Whether the layer's experts may be promoted into (and its residents evicted from) GPU slots."""
        return layer not in self._static

    @property
    def static_layers(self) -> frozenset:
        return self._static

    # -- statistics ---------------------------------------------------------------------------------------
    def observe(self, layer: int, experts) -> None:
        """One call's picks of a layer (any iterable of expert ids, repeats counted)."""
        ids = np.asarray(experts, dtype=np.int64).ravel()
        if ids.size:
            np.add.at(self.counts[self.row[layer]], ids, 1.0)

    def observe_rows(self, ids: np.ndarray) -> None:
        """A decode step's picks of every layer at once: ids [layers, pairs], row i = self.layers[i]."""
        rows = np.broadcast_to(np.arange(ids.shape[0])[:, None], ids.shape)
        np.add.at(self.counts, (rows.ravel(), ids.ravel().astype(np.int64)), 1.0)

    # -- planning -----------------------------------------------------------------------------------------
    def note_promotion(self, layer: int) -> None:
        self.promoted[self.row[layer]] += 1

    def due(self, picks: int) -> bool:
        """`picks` more picks of a layer (one call's, or a decode step's per layer): whether a plan is due."""
        self.picks += picks
        return self.picks >= self.every

    def plan(self, resident, rates: dict) -> list[int]:
        """Re-plan every layer from the window's counts. resident(layer) → how many of the layer's experts are in
        GPU slots now; rates {lane: GB/s} for pcie and cpu (0 or absent: none). Decays the counts; logs one line
        per change. → the layers whose mode changed."""
        picks, self.picks = max(1, self.picks), 0
        self.replans += 1
        pcie = (rates.get("pcie") or 0.0) * 1e9
        cpu = (rates.get("cpu") or 0.0) * 1e9
        miss_lane, miss_rate = ("cpu", cpu) if cpu > pcie else ("pcie", pcie)
        changed = []
        for layer, p in self.plans.items():
            counts = self.counts[self.row[layer]]
            on_gpu = resident(layer)
            p.gpu_experts = on_gpu
            p.miss_lane = miss_lane
            if self.mode != "auto" or counts.sum() < MIN_PICKS:
                continue
            h = self.share if self.share is not None else on_gpu
            p.hot = h if 0 < h < self.experts else max(1, self.experts // 8)
            p.skew, p.noise = skew_and_noise(counts, p.hot)
            b = self.record_bytes
            p.gain_s = max(0.0, p.skew) * b / miss_rate if miss_rate else 0.0
            p.churn_s = float(self.promoted[self.row[layer]]) / picks * b / pcie if pcie else 0.0
            excess = p.skew - p.noise
            if p.mode == "static":
                want = excess > ENTER and (p.gain_s >= p.churn_s or not miss_rate)
            else:
                want = not (excess < LEAVE or (miss_rate and p.churn_s > 1.5 * p.gain_s))
            mode = "cache" if want else "static"
            if mode != p.mode:
                p.mode = mode
                p.changes += 1
                self.changes += 1
                changed.append(layer)
                log.info("placement: layer %d -> %s (skew %.3f, noise %.3f, %d on GPU, miss lane %s, gain %.2f us/pick, "
                         "churn %.2f us/pick)", layer, mode, p.skew, p.noise, on_gpu, miss_lane, p.gain_s * 1e6,
                         p.churn_s * 1e6)
        self.counts *= self.decay
        self.promoted[:] = 0
        self._static = frozenset(layer for layer, p in self.plans.items() if p.mode == "static")
        return changed

    def summary(self) -> dict:
        modes = [p.mode for p in self.plans.values()]
        return {"mode": self.mode, "every_picks": self.every, "replans": self.replans, "changes": self.changes,
                "layers_static": modes.count("static"), "layers_cache": modes.count("cache"),
                "layers": {str(layer): p.as_dict() for layer, p in self.plans.items()}}


__all__ = ["PLANS", "LayerPlan", "Planner", "skew_and_noise"]

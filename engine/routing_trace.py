"""Bench routing (`--bench-routing`): FOR BENCHMARKING ONLY. Replaces a MoE router's top-k *choice* of experts
with a drawn one, so that an offload figure is measured under routing a real model could give rather than under
the synthetic checkpoint's own router, which sends almost every token to the same experts (99.5 % GPU-slot hits
on the H200, issue 32). The router still runs and its weights keep their shape and values: only which experts
the provider computes changes, which is all an expert cache's cost depends on. Output tokens are NOT the model's.

Modes (../shared/BENCH.md, "Routing"):
  model       the model's own router (the default: nothing is replaced);
  uniform     each token's top-k drawn uniformly without replacement, per layer: the cache's worst case;
  calibrated  per layer a fixed random permutation of the experts weighted Zipf(s), top-k drawn without
              replacement (Plackett-Luce), s fitted so the hottest 11.4 % of the experts take 39 % of the picks
              (the share the seed's VRAM cache served on a real GLM-5.3-Flash stream): calibrate(n_experts, top_k).
              Fitted on the draws without replacement: s = 0.709 for 128 experts and 0.650 for 288 at top-8.
              BENCH.md's s ≈ 0.66 / 0.63 are the Zipf *weight* share of the hottest 11.4 %; drawn without
              replacement (a token cannot pick one hot expert twice) they give 0.365 / 0.378 of the picks.

How a draw is made, so that it runs in every provider path and inside a captured CUDA graph, at a few tiny
kernels a layer: at install, each MoE layer gets a pool of POOL tokens' picks, drawn on the CPU from a hash
(splitmix64 in int64 tensor ops) of (seed, layer, token, expert) turned into Gumbel variates — the top-k of
log-weight + Gumbel is a draw without replacement with probabilities proportional to the weights (the Gumbel-top-k
trick) — and kept on the model's device. A call of t rows reads the pool's next t tokens (a position counter on
the device, advanced in place: no host value, so a graph replay reads the next ones too). No RNG state: the same
seed and the same sequence of calls give the same picks, on the CPU and on CUDA, eager or replayed. The pool
repeats every POOL tokens of a layer, far beyond any cache's reuse distance here.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn

MODES = ("model", "uniform", "calibrated")
POOL = 16384               # tokens' picks drawn per layer at install
HOT_SHARE = 0.114          # the seed's VRAM cache: this share of the experts ...
HOT_PICKS = 0.39           # ... served this share of one stream's picks


def _signed(x: int) -> int:
    """A 64-bit constant as torch's int64 (two's complement)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_GOLD = _signed(0x9E3779B97F4A7C15)
_MASK = {s: (1 << (64 - s)) - 1 for s in (27, 30, 31)}


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping multiplies; logical right shifts by masking)."""
    z = z ^ ((z >> 30) & _MASK[30])
    z = z * _M1
    z = z ^ ((z >> 27) & _MASK[27])
    z = z * _M2
    return z ^ ((z >> 31) & _MASK[31])


def uniforms(seed: int, layer: int, counter: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """[rows, n] float32 in (0, 1), a pure function of (seed, layer, counter value, row, column): 24-bit hashes."""
    dev = counter.device
    r = torch.arange(rows, device=dev, dtype=torch.int64).view(-1, 1)
    e = torch.arange(n, device=dev, dtype=torch.int64).view(1, -1)
    salt = _signed(((seed * 1_000_003 + layer) * 0x94D049BB133111EB) % (1 << 64))
    base = _mix(counter.view(1, 1) * _GOLD + salt)
    z = _mix(base + r * _M1 + e * _GOLD)
    return (((z >> 40) & 0xFFFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def zipf_log_weights(n: int, s: float, perm: torch.Tensor) -> torch.Tensor:
    """log of Zipf(s) weights over the ranks, rank r at expert perm[r]."""
    logw = -s * torch.log(torch.arange(1, n + 1, dtype=torch.float64))
    out = torch.empty(n, dtype=torch.float64)
    out[perm] = logw
    return out.to(torch.float32)


def draw(logw: torch.Tensor | None, u: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k without replacement with P ∝ exp(logw) (Gumbel-top-k), or uniform when logw is None. → [rows, k]."""
    keys = u if logw is None else logw - torch.log(-torch.log(u))
    return torch.topk(keys, top_k, dim=-1).indices


def _gumbels(n_experts: int, draws: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(draws, n_experts, generator=g).clamp_(1e-7, 1 - 1e-7)
    return -torch.log(-torch.log(u))


def hot_share(n_experts: int, top_k: int, s: float, draws: int = 20000, seed: int = 0,
              hot: int | None = None, gumbels: torch.Tensor | None = None) -> float:
    """The share of picks that land on the hottest `hot` experts (default round(11.4 % of n)) under Zipf(s)
    top-k without replacement: a Monte Carlo estimate over `draws` tokens, seeded (deterministic)."""
    hot = hot if hot is not None else hot_count(n_experts)
    logw = zipf_log_weights(n_experts, s, torch.arange(n_experts))
    g = gumbels if gumbels is not None else _gumbels(n_experts, draws, seed)
    ids = torch.topk(logw + g, top_k, dim=-1).indices
    return float((ids < hot).float().mean())


def hot_count(n_experts: int) -> int:
    """How many experts the seed's 11.4 % cache is at this expert count."""
    return max(1, round(HOT_SHARE * n_experts))


@lru_cache(maxsize=None)
def calibrate(n_experts: int, top_k: int, target: float = HOT_PICKS) -> float:
    """Zipf's s such that the hottest 11.4 % of `n_experts` take `target` of the top-k picks: bisection on
    hot_share over one fixed set of draws (monotone in s), to 1e-3 of s."""
    hot = hot_count(n_experts)
    if hot >= n_experts or top_k >= n_experts:
        return 0.0
    g = _gumbels(n_experts, 20000, 0)       # the same draws at every s: the estimate is monotone in s
    share = lambda s: hot_share(n_experts, top_k, s, hot=hot, gumbels=g)       # noqa: E731
    lo, hi = 0.0, 3.0
    if share(lo) >= target:
        return 0.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        if share(mid) < target:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 4)


class BenchRouting:
    """The drawn routing of one model (see the module docstring): __call__(layer, ids) → ids of the same shape,
    dtype and device, drawn for this call."""

    def __init__(self, mode: str, n_experts: int, top_k: int, layers, *, seed: int = 0, device="cpu",
                 pool: int = POOL):
        if mode not in MODES or mode == "model":
            raise ValueError(f"bench routing {mode!r} is not one of {', '.join(m for m in MODES if m != 'model')}")
        if not 0 < top_k <= n_experts:
            raise ValueError(f"top_k {top_k} must be within 1..{n_experts}")
        self.mode, self.n, self.k, self.seed = mode, n_experts, top_k, int(seed)
        self.device = torch.device(device)
        layers = sorted(layers)
        self.pool_size = pool
        self.pos = {l: torch.zeros(1, dtype=torch.int64, device=self.device) for l in layers}
        self.s = calibrate(n_experts, top_k) if mode == "calibrated" else 0.0
        self.logw: dict[int, torch.Tensor | None] = {}
        g = torch.Generator().manual_seed(self.seed)
        for l in layers:        # a fixed random permutation per layer: which experts are hot differs by layer
            perm = torch.randperm(n_experts, generator=g)
            self.logw[l] = zipf_log_weights(n_experts, self.s, perm).to(self.device) if mode == "calibrated" else None
        self.ranks = {}         # layer -> experts hottest first (what a perfect static split would keep)
        if mode == "calibrated":
            for l in layers:
                self.ranks[l] = torch.argsort(self.logw[l].cpu(), descending=True).tolist()
        self.pool = {}
        for l in layers:                 # drawn in blocks on the CPU: [pool, E] float32 at once would be large
            logw = self.logw[l].cpu() if self.logw[l] is not None else None
            picks = [draw(logw, uniforms(self.seed, l, torch.tensor([i]), min(1024, pool - i * 1024), n_experts),
                          top_k) for i in range((pool + 1023) // 1024)]
            self.pool[l] = torch.cat(picks).to(self.device)

    def describe(self) -> dict:
        d = {"mode": self.mode, "seed": self.seed, "experts": self.n, "top_k": self.k}
        if self.mode == "calibrated":
            d.update(zipf_s=self.s, hot_share=HOT_SHARE, hot_experts=hot_count(self.n), hot_picks_target=HOT_PICKS)
        return d

    def mark(self) -> dict:
        """The pools' positions now (device copies), for rewind: a CUDA graph's eager warm-up step is replayed
        right after, and must draw what the replay draws (engine.gpu.graphs)."""
        return {l: p.clone() for l, p in self.pos.items()}

    def rewind(self, mark: dict) -> None:
        for l, p in self.pos.items():
            p.copy_(mark[l])

    def __call__(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        t, pos = ids.shape[0], self.pos[layer]
        rows = (pos + torch.arange(t, device=pos.device)) % self.pool_size
        pos.add_(t)
        return self.pool[layer].index_select(0, rows).to(ids.dtype)


class RoutedBlock(nn.Module):
    """A MoE block whose router's choice a BenchRouting may replace (MoEModel / Glm5Next .use_bench_routing)."""

    bench: BenchRouting | None = None
    layer: int

    def use_bench(self, bench: BenchRouting | None) -> None:
        self.bench = bench

    def pick(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.bench is None else self.bench(self.layer, ids)


def install(model: nn.Module, mode: str, seed: int = 0) -> BenchRouting | None:
    """Replace `model`'s routing choice in every MoE block by `mode`'s draws (None for "model": nothing)."""
    if mode == "model":
        return None
    blocks = [m for m in model.modules() if isinstance(m, RoutedBlock)]
    cfg = model.cfg
    bench = BenchRouting(mode, cfg.n_experts, cfg.top_k, [b.layer for b in blocks], seed=seed, device=model.device)
    for b in blocks:
        b.use_bench(bench)
    return bench


__all__ = ["MODES", "BenchRouting", "RoutedBlock", "calibrate", "hot_count", "hot_share", "install", "uniforms"]

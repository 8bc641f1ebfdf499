"""Prometheus metrics on a private registry (one per app, so tests and several apps never collide).

Engine totals (expert serves per tier, store bytes, token counts) are read from `LLM.counters()`
at scrape time, so they count every token the engine ran, cancelled streams included; the
server itself measures latencies and how many requests run or wait.

Per lane of a tiered provider (engine.tiers.lanes: gpu, cpu, pcie, disk), so that a measured speed can
stand beside its lane bound t >= max(t_gpu, B_pcie/BW_pcie, B_disk/BW_disk, B_cpu/BW_cpu):
  kiln_lane_picks_total{lane}         gpu/cpu: picks computed there; pcie: records copied; disk: records read
  kiln_lane_bytes_total{lane}         record bytes moved (pcie, disk) or computed from (gpu, cpu)
  kiln_lane_busy_seconds_total{lane}  cpu: the lane thread's jobs; pcie: copy-stream time (CUDA events);
                                      disk: read batches; gpu: 0 (a graph-replayed step is not timed inside)
  kiln_lane_rate_bytes_per_second{lane,source}  the rates the cost model uses (source: config or measured)
and, where a tiered provider decodes zero-copy (engine.tiers.zero_copy; its pcie lane counts these reads too):
  kiln_zero_copy_decode               1 while RAM-tier records are read in place
  kiln_read_in_place_bytes_total      record bytes the GPU kernels read from the RAM tier over PCIe
  kiln_promotions_total               records copied from RAM into GPU slots between steps
and the per-layer placement plan (engine.tiers.placement): kiln_placement_layer_mode{layer,mode},
kiln_placement_layer_skew{layer}, kiln_placement_layer_gpu_experts{layer}, kiln_placement_replans_total,
kiln_placement_changes_total; kiln_bench_routing{mode} while --bench-routing draws the picks.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class _EngineCollector:
    """Exports the engine's own counters; nothing until the model is loaded."""

    def __init__(self, counters: Callable[[], dict | None]):
        self.counters = counters

    def collect(self):
        c = self.counters()
        if c is None:
            return
        served = CounterMetricFamily("kiln_expert_served", "Routed expert computations, by the tier that served the weights",
                                     labels=["tier"])
        for tier in ("gpu", "ram", "store"):
            served.add_metric([tier], float((c.get("served") or {}).get(tier, 0)))
        yield served
        for key, name, doc in (
                ("store_read_bytes", "kiln_store_read_bytes", "Bytes read from the expert store"),
                ("pcie_bytes", "kiln_pcie_bytes", "Bytes copied from the RAM tier into GPU expert slots"),
                ("writeback_bytes", "kiln_writeback_bytes", "Bytes of evicted GPU-slot records copied back into the RAM tier"),
                ("prompt_tokens_total", "kiln_prompt_tokens", "Prompt tokens prefilled"),
                ("generation_tokens_total", "kiln_generation_tokens", "Tokens generated"),
                ("decode_graph_replays", "kiln_decode_graph_replays", "Decode steps replayed from CUDA graphs"),
                ("decode_sampler_graph_replays", "kiln_decode_sampler_graph_replays", "Decode steps whose tokens were "
                 "drawn by the sampler captured as a CUDA graph after the step's"),
                ("decode_ahead_steps_total", "kiln_decode_ahead_steps", "Decode steps launched from the last step's "
                 "argmax on the GPU before the host read it, and used"),
                ("decode_ahead_redone_total", "kiln_decode_ahead_redone", "Decode steps launched ahead and not used "
                 "(a stream ended or joined): run again from the host's tokens"),
                ("prefix_cache_lookups_total", "kiln_prefix_cache_lookups", "Prompts looked up in the prefix cache"),
                ("prefix_cache_hits_total", "kiln_prefix_cache_hits", "Prompts whose prefill started after a prefix a KV "
                 "slot already held"),
                ("prefix_cache_reused_tokens_total", "kiln_prefix_cache_reused_tokens", "Prompt tokens not prefilled "
                 "because a KV slot already held them"),
                ("failed_requests_total", "kiln_requests_failed", "Requests whose own generation failed (the others went on)"),
                ("rejected_requests_total", "kiln_requests_rejected", "Requests refused with 429: the queue was full")):
            yield CounterMetricFamily(name, doc, value=float(c.get(key, 0)))
        yield from _lane_metrics(c)
        zc = c.get("zero_copy")
        if c.get("provider") == "tiered":
            yield GaugeMetricFamily("kiln_zero_copy_decode", "1 while decode reads RAM-tier records in place (zero-copy)",
                                    value=float(zc is not None))
        if zc is not None:
            yield CounterMetricFamily("kiln_read_in_place_bytes", "Record bytes the GPU kernels read from the RAM tier "
                                      "in place over PCIe", value=float(zc["read_in_place_bytes"]))
            yield CounterMetricFamily("kiln_promotions", "Records copied from the RAM tier into GPU slots between "
                                      "zero-copy decode steps", value=float(zc["promotions"]))
        yield from _placement_metrics(c)
        if (bench := c.get("bench_routing")) is not None:
            g = GaugeMetricFamily("kiln_bench_routing", "1 while the routers' choice is replaced by drawn picks "
                                  "(--bench-routing: benchmarking only; outputs are not the model's)", labels=["mode"])
            g.add_metric([bench["mode"]], 1.0)
            yield g
        if c.get("provider"):
            kind = GaugeMetricFamily("kiln_expert_provider", "1 for the provider that serves the routed experts",
                                     labels=["provider"])
            kind.add_metric([c["provider"]], 1.0)
            yield kind


def _placement_metrics(c: dict):
    """A tiered provider's plan (engine.tiers.placement): each MoE layer's mode, skew and GPU experts."""
    plan = c.get("placement")
    if not plan:
        return
    mode = GaugeMetricFamily("kiln_placement_layer_mode", "1 for each MoE layer's plan: static (its GPU experts stay) "
                             "or cache (its hot experts are promoted)", labels=["layer", "mode"])
    skew = GaugeMetricFamily("kiln_placement_layer_skew", "Share of a layer's picks on its hottest experts beyond "
                             "a uniform routing's", labels=["layer"])
    gpu = GaugeMetricFamily("kiln_placement_layer_gpu_experts", "A layer's experts in GPU slots at the last plan",
                            labels=["layer"])
    for layer, p in plan["layers"].items():
        mode.add_metric([layer, p["mode"]], 1.0)
        skew.add_metric([layer], p["skew"])
        gpu.add_metric([layer], p["gpu_experts"])
    yield from (mode, skew, gpu)
    yield CounterMetricFamily("kiln_placement_replans", "Placement plans made while serving", value=plan["replans"])
    yield CounterMetricFamily("kiln_placement_changes", "Layers whose plan changed (one log line each)",
                              value=plan["changes"])


def _lane_metrics(c: dict):
    lanes = c.get("lanes")
    if not lanes:
        return
    for key, name, doc in (("picks", "kiln_lane_picks", "Expert picks (gpu, cpu), records copied (pcie) or read (disk), by lane"),
                           ("bytes", "kiln_lane_bytes", "Record bytes each lane moved or computed from"),
                           ("seconds", "kiln_lane_busy_seconds", "Busy seconds of each lane")):
        family = CounterMetricFamily(name, doc, labels=["lane"])
        for lane, counts in lanes.items():
            family.add_metric([lane], float(counts.get(key, 0)))
        yield family
    rates = c.get("lane_rates")
    if rates:
        family = GaugeMetricFamily("kiln_lane_rate_bytes_per_second", "Lane rates the CPU-expert cost model uses",
                                   labels=["lane", "source"])
        for lane in ("pcie", "cpu", "disk"):
            family.add_metric([lane, rates["source"].get(lane, "")], rates[f"{lane}_gbps"] * 1e9)
        yield family


class Metrics:
    def __init__(self, counters: Callable[[], dict | None]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(counters))
        self.request_seconds = Histogram("kiln_request_seconds", "Time from request to last byte, by endpoint",
                                         ["endpoint"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.ttft_seconds = Histogram("kiln_time_to_first_token_seconds", "Time from request to first generated token",
                                      ["endpoint"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.running = Gauge("kiln_requests_running", "Generations producing tokens", registry=self.registry)
        self.queued = Gauge("kiln_requests_queued", "Generations admitted, waiting for their first token",
                            registry=self.registry)
        self.load_state = _LoadState()
        self.registry.register(self.load_state)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LoadState:
    """kiln_model_ready (0/1) and kiln_model_load_seconds, set by the loader thread."""

    def __init__(self):
        self.ready = 0
        self.seconds = 0.0

    def collect(self):
        yield GaugeMetricFamily("kiln_model_ready", "1 once the model is loaded and serving", value=self.ready)
        yield GaugeMetricFamily("kiln_model_load_seconds", "Seconds the model took to load", value=self.seconds)

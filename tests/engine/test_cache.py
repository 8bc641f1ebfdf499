"""Eviction policies and the simulator, with counts worked out by hand."""
from __future__ import annotations

import json
import random

import pytest

from engine.cli import main
from engine.tiers.cache import LFU, LRU, Belady, ExpertCache, ExpertKey
from engine.tiers.simulate import compare, simulate

# Silberschatz's textbook reference string: 3 frames give LRU 12 faults and OPT 9.
TEXTBOOK = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def stats(policy, seq, slots):
    s = simulate(seq, slots, policy)
    return s.hits, s.misses, s.evictions


def test_lru_and_belady_on_the_textbook_string():
    assert stats(LRU(), TEXTBOOK, 3) == (8, 12, 9)
    assert stats(Belady(TEXTBOOK), TEXTBOOK, 3) == (11, 9, 6)


def test_lfu_evicts_the_least_used_and_remembers_counts_across_evictions():
    seq = list("AABCACB")
    # A A(hit) B; C evicts B (1 use < A's 2); A hit, C hit; B evicts C (2 uses < A's 3).
    assert stats(LFU(), seq, 2) == (3, 4, 2)
    assert stats(LRU(), seq, 2) == (2, 5, 3)
    assert stats(Belady(seq), seq, 2) == (3, 4, 2)


def test_lfu_breaks_ties_by_recency():
    c = ExpertCache("ram", 2, LFU())
    for k in "AB":
        c.admit(k)
    _, evicted = c.admit("C")
    assert evicted == "A" and set(c.resident()) == {"B", "C"}


@pytest.mark.parametrize("policy", [LRU, LFU])
def test_pinned_keys_are_never_evicted(policy):
    c = ExpertCache("ram", 2, policy())
    c.admit("A")
    c.admit("B")
    c.lookup("B")
    _, evicted = c.admit("C", pinned={"A"})
    assert evicted == "B" and set(c.resident()) == {"A", "C"}
    with pytest.raises(LookupError):
        c.admit("D", pinned={"A", "C"})


def test_cache_counts_hits_misses_evictions_and_reuses_freed_slots():
    c = ExpertCache("ram", 2, LRU())
    a = ExpertKey(0, 1)
    assert c.lookup(a) is None
    sa, ev = c.admit(a)
    assert (sa, ev) == (0, None)
    c.admit(ExpertKey(0, 2))
    assert c.lookup(a) == 0
    slot, ev = c.admit(ExpertKey(1, 1))
    assert ev == ExpertKey(0, 2) and slot == 1          # a's hit made (0, 2) the least recent
    assert (c.stats.hits, c.stats.misses, c.stats.evictions) == (1, 1, 1)


def skewed_trace(seed: int, steps=300, layers=4, experts=32, k=4):
    rng = random.Random(seed)
    weights = [1.0 / (e + 1) ** 1.1 for e in range(experts)]       # Zipf-like popularity, as routers are
    acc = []
    for _ in range(steps):
        for layer in range(layers):
            chosen = set()
            while len(chosen) < k:
                chosen.add(rng.choices(range(experts), weights)[0])
            acc.extend(ExpertKey(layer, e) for e in sorted(chosen))
    return acc


@pytest.mark.parametrize("seed,slots", [(0, 8), (1, 24), (2, 64)])
def test_belady_bounds_lru_and_lfu(seed, slots):
    r = compare(skewed_trace(seed), slots)
    assert r["belady"].hit_rate >= max(r["lru"].hit_rate, r["lfu"].hit_rate)
    assert r["belady"].hit_rate > 0 and r["lru"].hits + r["lru"].misses == len(skewed_trace(seed))


def write_trace(path, acc):
    with open(path, "w") as f:
        for key in acc:
            f.write(json.dumps({"layer": key.layer, "experts": [key.expert]}) + "\n")


def test_simulate_cache_cli_json_and_table(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    write_trace(trace, [ExpertKey(0, e) for e in TEXTBOOK])
    assert main(["simulate-cache", "--trace", str(trace), "--slots", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["accesses"] == 20
    assert {k: (v["hits"], v["misses"]) for k, v in out["policies"].items() if k != "lfu"} == \
        {"lru": (8, 12), "belady": (11, 9)}
    assert main(["simulate-cache", "--trace", str(trace), "--slots", "3"]) == 0
    table = capsys.readouterr().out
    assert "20 accesses, 6 distinct experts, 3 slots" in table
    assert all(p in table for p in ("lru", "lfu", "belady")) and "55.00%" in table


def test_simulate_cache_bad_trace_is_one_line_exit_2(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"layer": 0, "experts": [1]}\n{"layer": 0}\n')
    assert main(["simulate-cache", "--trace", str(trace), "--slots", "3"]) == 2
    assert capsys.readouterr().err == f"engine: {trace} line 2: not a routing step {{\"layer\": L, \"experts\": [..]}} (KeyError)\n"

"""Prefix reuse across requests: a new prompt that begins with tokens some KV slot already holds starts its
prefill after them, as llama-server's slots, vLLM's automatic prefix caching and SGLang's RadixAttention do.

The KV cache's slots are the store (engine.kv_cache): a finished sequence's slot keeps its keys and values
until the slot is taken again, so a chat's next turn (its history, then a new message) finds the last turn's
positions still there. The index here is block-granular: a slot's tokens are hashed BLOCK at a time as a
chain (each block's hash covers every token before it), and each block hash counts the slots that hold it
(a reference count: the hash goes when its last holder does). A lookup walks the prompt's blocks while some
slot holds them, then checks the tokens themselves, so a hash collision can only cost a miss, never a wrong
reuse.

Where the longest prefix lies:
  - in a free slot: the request takes that slot; nothing moves;
  - in a running sequence's slot (concurrent requests with one system prompt): the request takes a free slot
    and the prefix's positions are copied into it on the device (KVCache.copy_prefix), computed once for all.
Free slots are taken least recently used first, so eviction is LRU within the KV cache's own budget: the
prefixes kept cost no memory beyond the slots the engine already holds.

At least the prompt's last token is always prefilled (its logits give the first new token), and reuse is
whole blocks only. Outputs do not change: a reused prefix is the same positions the prefill would compute,
and the rest is prefilled from there exactly as a later chunk of a chunked prefill is.

Caches with a recurrent state (glm5_next's KDA layers) can be resumed only where they kept a snapshot of it
(SlotCaches.resumable), so a lookup reuses up to the holder's latest snapshot inside the shared blocks. Where
that falls short of the shared blocks' end, the prompt branches off there from another that begins alike (a
system prompt, say): its prefill keeps a snapshot at that branch point (SlotCaches.keep_at), so the next prompt
that shares it resumes there. A prefill also keeps one at its prompt's last whole block, and the cache one at the
latest block boundary its decode crossed, so a chat's next turn resumes after the last turn's reply.
"""
from __future__ import annotations

from engine.kv_cache import SlotCaches

BLOCK = 16          # tokens a block: small, since a hit's cost is a copy and a miss's the block's prefill


class PrefixCache:
    """The scheduler's slot allocation with prefix reuse (the scheduler's thread only)."""

    def __init__(self, kv: SlotCaches, block: int = BLOCK):
        assert block > 0, "a prefix block holds at least one token"
        self.kv, self.block = kv, block
        kv.prepare_reuse(block)
        self._tokens: dict[int, list[int]] = {}        # slot -> the tokens whose positions it holds
        self._hashes: dict[int, list[int]] = {}        # slot -> its full blocks' chain hashes
        self._holders: dict[int, set[int]] = {}        # block chain hash -> the slots holding it (its references)
        self._released: dict[int, int] = {}            # slot -> release tick (LRU among free slots)
        self._tick = 0
        self.lookups = self.hits = self.reused_tokens = 0

    # --- the scheduler's calls, in place of KVCache.alloc / release ---
    def admit(self, prompt: list[int], reuse: bool = True) -> tuple[int, int]:
        """A slot for `prompt` and how many of its leading tokens that slot now holds (prefill starts there).
        reuse=False: none (a prompt whose every position's logits are wanted: its prompt logprobs); the slot is
        still taken least recently used first, and its prompt is published for others once prefilled."""
        self.lookups += 1
        src, n, shared = self._longest(prompt) if reuse else (None, 0, 0)
        free = self.kv.free_list()
        if src is not None and src in free:
            slot = src
        else:
            # Least recently released first; never-used slots lowest-first, as KVCache.alloc hands them out.
            slot = min(free, key=lambda s: (self._released.get(s, -1), s))
        self._forget(slot)                             # its old positions are about to be overwritten
        self.kv.alloc(slot)
        if n and src != slot:
            self.kv.copy_prefix(src, slot, n)
        else:
            self.kv.resume(slot, n)
        # Where later prompts may go on from: where this one branches off another, and its last whole block.
        self.kv.keep_at(slot, {p for p in (shared, len(prompt) // self.block * self.block) if p > n})
        if n:
            self.hits += 1
            self.reused_tokens += n
        return slot, n

    def publish(self, slot: int, tokens: list[int]) -> None:
        """`slot` holds `tokens`' positions (a running sequence's prompt once prefilled): others may reuse them."""
        self._forget(slot)
        self._tokens[slot] = list(tokens)
        h, hashes = 0, []
        for i in range(len(tokens) // self.block):
            h = hash((h, tuple(tokens[i * self.block:(i + 1) * self.block])))
            hashes.append(h)
            self._holders.setdefault(h, set()).add(slot)
        self._hashes[slot] = hashes

    def release(self, slot: int, tokens: list[int] | None) -> None:
        """The sequence in `slot` ended holding `tokens`' positions; None: its positions are not to be trusted (a
        failed step), so nothing is kept."""
        self.kv.release(slot)
        self._tick += 1
        self._released[slot] = self._tick
        if tokens is None:
            self._forget(slot)
        else:
            self.publish(slot, tokens)

    def counters(self) -> dict:
        return dict(prefix_cache_lookups_total=self.lookups, prefix_cache_hits_total=self.hits,
                    prefix_cache_reused_tokens_total=self.reused_tokens)

    # --- the index ---
    def _longest(self, prompt: list[int]) -> tuple[int | None, int, int]:
        """(the slot to go on from, how many tokens of prompt it gives, how many leading tokens some slot holds):
        whole blocks, the last token always left to prefill; the holder that gives most where its state is
        resumable (SlotCaches.resumable), a free one before a running one (no copy)."""
        h, depth = 0, {}                               # slot -> how many leading blocks' tokens it holds
        for i in range((len(prompt) - 1) // self.block):
            h = hash((h, tuple(prompt[i * self.block:(i + 1) * self.block])))
            slots = self._holders.get(h)
            if not slots:
                break
            depth.update(dict.fromkeys(slots, (i + 1) * self.block))
        free = set(self.kv.free_list())
        best, best_key, shared = None, (0,), 0
        for slot, d in depth.items():
            if self._tokens[slot][:d] != prompt[:d]:   # the tokens, not only their hashes
                continue
            shared = max(shared, d)
            n = self.kv.resumable(slot, d)
            key = (n, slot in free, -slot)
            if n and key > best_key:
                best, best_key = slot, key
        return best, best_key[0], shared

    def _forget(self, slot: int) -> None:
        for h in self._hashes.pop(slot, ()):
            holders = self._holders[h]
            holders.discard(slot)
            if not holders:
                del self._holders[h]
        self._tokens.pop(slot, None)

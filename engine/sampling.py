"""Next-token choice for a batch of sequences: greedy, or temperature + top-p with a torch.Generator
per request, so a seeded request draws the same tokens whether it runs alone or batched."""
from __future__ import annotations

import secrets

import torch


def make_generator(seed: int | None, device: str | torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed if seed is not None else secrets.randbits(63))


def sample_row(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token id (0-dim tensor) from logits [V]: softmax(logits / T) truncated to the smallest set of
    tokens whose probability reaches top_p (always at least the most likely one)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Drop a token when the mass before it already reaches top_p.
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        return order[torch.multinomial(sorted_p, 1, generator=generator)[0]]
    return torch.multinomial(probs, 1, generator=generator)[0]


def choose(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           generators: list[torch.Generator | None]) -> list[int]:
    """Token ids for logits [B, V]; a row with temperature 0 is greedy. One host sync for the batch."""
    out = logits.argmax(dim=-1)
    for i, t in enumerate(temperatures):
        if t > 0.0:
            out[i] = sample_row(logits[i], t, top_ps[i], generators[i])
    return out.tolist()

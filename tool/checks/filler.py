"""Filler text for long prompts: plain sentences, cut to an exact number of words, with an optional
needle sentence at a chosen depth. Words are the sizing unit because they are about one token each
in every tokenizer, so rescaling by the server's count converges in a few steps."""
from __future__ import annotations

from itertools import cycle, islice

SENTENCES = (
    "The morning market opened early and the bakers set out their bread in long rows.",
    "A gull circled the harbour twice before settling on the mast of a small fishing boat.",
    "Rain had fallen through the night, and the cobbled street still shone under the lamps.",
    "In the library the clock ticked slowly while a student copied notes from an old atlas.",
    "The river carried leaves past the mill, where the wheel turned with a patient creak.",
    "Farmers spoke about the weather, the price of grain and the new road to the valley.",
    "On the hill a shepherd counted his flock and found that every sheep had come home.",
    "The train from the coast arrived late, its windows fogged with the breath of travellers.",
    "Children chalked a map of the town on the pavement and argued about where the sea was.",
    "An old carpenter planed a board until the grain showed like water under the varnish.",
)


def words(n: int, offset: int = 0) -> list[str]:
    stream = (w for s in cycle(SENTENCES) for w in s.split())
    return list(islice(stream, offset, offset + n))


def build(n_words: int, needle: str | None = None, depth: float = 0.5, lead: str = "") -> str:
    """n_words of filler with `needle` inserted at the sentence boundary nearest `depth` (0..1)."""
    ws = words(n_words)
    if needle is not None:
        at = round(depth * len(ws))
        ends = [i + 1 for i, w in enumerate(ws) if w.endswith(".")] or [len(ws)]
        at = min([0] + ends, key=lambda i: abs(i - at))
        ws = ws[:at] + needle.split() + ws[at:]
    return (lead + " " if lead else "") + " ".join(ws)

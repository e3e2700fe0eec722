"""Workload cards: a few numbers that describe a workload, turned into a seeded trace ``kvtier decide`` times.

A YAML mapping; every key is optional (the defaults below) and a bad one is a :class:`CardError` naming it::

    requests: 200            # how many requests the trace holds
    seed: 0
    arrival:
      rate_per_s: 1.0        # requests per second, all sessions together (the trace opens in steady state)
      burstiness: 1.0        # coefficient of variation of the gaps between sessions: 1 Poisson, 0 even, >1 bursts
    prompt_tokens:           # each turn's new tokens (the user's message), lognormal; the prompt is the
                             # shared prefix, the document, the session's earlier turns and this message
      median: 1000
      p90: 1000              # equal to the median: every message is that long
    output_tokens: 64
    shared_prefix:
      tokens: 0              # a system prompt at the head of every prompt
      fan_out: 1             # how many different ones; each session picks one
    sessions:
      turns: 1               # each turn's prompt is the last prompt, its answer and a new message
      think_time_s: 0.0      # between a session's turns (> 0 when turns > 1)
    tenants: 1               # KV is never shared across tenants (each has its own cache salt)
    lora_adapters: 0         # sessions spread over adapters of one base model (0: the base model); not shared
    documents:
      count: 0               # a document after the system prompt, drawn with a Zipf popularity
      tokens: 4000
      skew: 1.0              # Zipf exponent (0: uniform)
    lossy_kv: false          # true: the workload may take KV a lossy codec stored (fp8, k16v8), and kvtier decide
                             # weighs them; false: only exact codecs (none, lossless)

Blocks are keyed as kvtier keys chunks: by everything before them and by their tenant and adapter, so two
prompts share a block exactly when they share every token up to its end in the same tenant and adapter.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.config import FieldReader
from kvtier.errors import KVTierError
from kvtier.sim.trace import Request, Trace


class CardError(KVTierError, ValueError):
    """A workload card is malformed: the message names the field."""


_F = FieldReader(CardError)
_TOP = ("requests", "seed", "arrival", "prompt_tokens", "output_tokens", "shared_prefix", "sessions", "tenants",
        "lora_adapters", "documents", "lossy_kv")
_MAX_TOKENS = 1 << 20
_MAX_PROMPT = 1 << 20
_MAX_TURNS = 10_000_000  # turns of all sessions generated (under 100 MB of message lengths)


@dataclasses.dataclass(frozen=True)
class Card:
    requests: int = 200
    seed: int = 0
    rate_per_s: float = 1.0
    burstiness: float = 1.0
    prompt_median: int = 1000
    prompt_p90: int = 1000
    output_tokens: int = 64
    prefix_tokens: int = 0
    fan_out: int = 1
    turns: int = 1
    think_time_s: float = 0.0
    tenants: int = 1
    lora_adapters: int = 0
    documents: int = 0
    document_tokens: int = 4000
    skew: float = 1.0
    lossy_kv: bool = False
    source: str = "card"


@dataclasses.dataclass(frozen=True)
class Workload:
    """A card's trace, with the session of every request (routing keeps a session on one engine)."""

    trace: Trace
    sessions: tuple[int, ...]


def load_card(source: str | Path | Mapping[str, Any]) -> Card:
    raw = _F.load(source, "workload card")
    top = _F.mapping({} if raw is None else raw, "card", _TOP)  # an empty card takes every default
    arrival = _F.section(top, "arrival", ("rate_per_s", "burstiness"))
    prompt = _F.section(top, "prompt_tokens", ("median", "p90"))
    prefix = _F.section(top, "shared_prefix", ("tokens", "fan_out"))
    sessions = _F.section(top, "sessions", ("turns", "think_time_s"))
    docs = _F.section(top, "documents", ("count", "tokens", "skew"))
    median = _F.int(prompt, "median", "prompt_tokens", default=1000, maximum=_MAX_TOKENS)
    p90 = _F.int(prompt, "p90", "prompt_tokens", default=median, maximum=_MAX_TOKENS)
    if p90 < median:
        raise CardError(f"prompt_tokens.p90: {p90} is below the median {median}")
    card = Card(
        requests=_F.int(top, "requests", "card", default=200, maximum=1_000_000),
        seed=_F.int(top, "seed", "card", default=0, minimum=0),
        rate_per_s=_F.number(arrival, "rate_per_s", "arrival", default=1.0, minimum=1e-6, maximum=1e6),
        burstiness=_F.number(arrival, "burstiness", "arrival", default=1.0, maximum=100),
        prompt_median=median, prompt_p90=p90,
        output_tokens=_F.int(top, "output_tokens", "card", default=64, maximum=_MAX_TOKENS),
        prefix_tokens=_F.int(prefix, "tokens", "shared_prefix", default=0, minimum=0, maximum=_MAX_TOKENS),
        fan_out=_F.int(prefix, "fan_out", "shared_prefix", default=1, maximum=1_000_000),
        turns=_F.int(sessions, "turns", "sessions", default=1, maximum=1000),
        think_time_s=_F.number(sessions, "think_time_s", "sessions", default=0.0, maximum=1e6),
        tenants=_F.int(top, "tenants", "card", default=1, maximum=1_000_000),
        lora_adapters=_F.int(top, "lora_adapters", "card", default=0, minimum=0, maximum=100_000),
        documents=_F.int(docs, "count", "documents", default=0, minimum=0, maximum=1_000_000),
        document_tokens=_F.int(docs, "tokens", "documents", default=4000, maximum=_MAX_TOKENS),
        skew=_F.number(docs, "skew", "documents", default=1.0, maximum=10),
        lossy_kv=_F.bool(top, "lossy_kv", "card", default=False),
        source=str(source) if not isinstance(source, Mapping) else "card")
    if 0 < card.burstiness < 0.01:
        raise CardError(f"arrival.burstiness: 0 (even gaps) or from 0.01 to 100, got {card.burstiness!r}")
    if card.turns > 1 and card.think_time_s <= 0:
        raise CardError("sessions.think_time_s: must be > 0 when sessions.turns > 1 (a turn is sent after the "
                        "previous one's answer)")
    return card


def generate(card: Card, block_tokens: int) -> Workload:
    """The card's trace, the same for the same card and seed.

    Sessions start as a renewal process (gamma gaps with the card's coefficient of variation) at
    ``rate_per_s / turns``, their turns ``think_time_s`` apart. Sessions begin before time 0, so that the trace
    opens in steady state (its first requests include later turns of sessions already under way, whose history
    the engine never computed) and holds the first ``requests`` requests from time 0 on: they arrive at
    ``rate_per_s`` from the first to the last.
    """
    span = (card.turns - 1) * card.think_time_s
    session_rate = card.rate_per_s / card.turns
    horizon = card.requests / card.rate_per_s
    sessions = math.ceil((span + horizon) * session_rate * 1.25) + 8
    while True:
        if sessions * card.turns > _MAX_TURNS:
            raise CardError(f"sessions.think_time_s: sessions lasting {span:g} s at {card.rate_per_s:g} requests/s "
                            f"need over {_MAX_TURNS:,} turns of sessions for {card.requests} requests; shorten the "
                            "think time or lower the rate")
        rows = _sessions(card, sessions, span)
        if len(rows) >= card.requests:
            break
        sessions *= 2  # an unlucky draw: arrivals thinner than their mean
    rows = sorted(rows, key=lambda row: row[0])[:card.requests]
    ids: dict[object, int] = {}
    requests = []
    for index, (at, _, segments, namespace) in enumerate(rows):
        blocks, length = _blocks(segments, namespace, block_tokens, ids)
        if length > _MAX_PROMPT:
            raise CardError(f"sessions.turns: a prompt reaches {length:,} tokens (shared prefix + document + turns "
                            f"x (message + answer)); at most {_MAX_PROMPT:,}")
        if length % block_tokens:  # the partial tail: never stored, never shared
            blocks.append(ids.setdefault(("tail", index), len(ids)))
        requests.append(Request(at * 1000, length, card.output_tokens, tuple(blocks), length // block_tokens))
    return Workload(Trace(tuple(requests), block_tokens, card.source), tuple(row[1] for row in rows))


def _sessions(card: Card, count: int, span: float
              ) -> list[tuple[float, int, list[tuple[object, int]], tuple[int, int]]]:
    """Every turn from time 0 on of ``count`` sessions, the first starting ``span`` seconds before 0."""
    rng = np.random.default_rng(card.seed)
    mean_gap = card.turns / card.rate_per_s
    if card.burstiness == 0:
        gaps = np.full(count, mean_gap)
    else:
        shape = 1 / card.burstiness**2
        gaps = rng.gamma(shape, mean_gap / shape, count)
    starts = np.cumsum(gaps) - gaps[0] - span
    tenants = rng.integers(card.tenants, size=count)
    adapters = rng.integers(card.lora_adapters, size=count) if card.lora_adapters else np.full(count, -1)
    systems = rng.integers(card.fan_out, size=count)
    if card.documents:
        weights = 1.0 / np.arange(1, card.documents + 1) ** card.skew
        documents = rng.choice(card.documents, size=count, p=weights / weights.sum())
    sigma = math.log(card.prompt_p90 / card.prompt_median) / 1.2816  # z of the 90th percentile
    messages = np.clip(np.round(card.prompt_median * np.exp(sigma * rng.standard_normal((count, card.turns)))),
                       1, _MAX_TOKENS).astype(int)
    rows = []
    for s in range(count):
        head: list[tuple[object, int]] = []
        if card.prefix_tokens:
            head.append((("system", int(systems[s])), card.prefix_tokens))
        if card.documents:
            head.append((("document", int(documents[s])), card.document_tokens))
        for turn in range(card.turns):
            at = float(starts[s] + turn * card.think_time_s)
            head = head + [(("message", s, turn), int(messages[s, turn]))]
            if at >= 0:
                rows.append((at, s, head, (int(tenants[s]), int(adapters[s]))))
            head = head + [(("answer", s, turn), card.output_tokens)]
    return rows


def _blocks(segments: list[tuple[object, int]], namespace: tuple[int, int], block_tokens: int,
            ids: dict[object, int]) -> tuple[list[int], int]:
    """The prompt's whole blocks, each keyed by its parent's key and the pieces of segments it holds."""
    blocks: list[int] = []
    parent: object = namespace
    pieces: list[tuple[object, int, int]] = []
    filled = 0
    length = 0
    for segment, size in segments:
        offset = 0
        while offset < size:
            take = min(size - offset, block_tokens - filled)
            pieces.append((segment, offset, offset + take))
            offset += take
            filled += take
            if filled == block_tokens:
                parent = ids.setdefault((parent, tuple(pieces)), len(ids))
                blocks.append(parent)
                pieces, filled = [], 0
        length += size
    return blocks, length

"""Request traces for the simulator, read line by line with errors that name the line and the field.

Three kinds of JSONL line, told apart by their fields:

- Mooncake (FAST'25): ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``,
  ``hash_ids`` being prefix-chained ids of ``block_tokens``-token blocks (``ceil(input_length / block_tokens)``
  of them; two requests share an id only if they share the whole prefix up to that block).
- Tokens: ``{"timestamp": ms, "token_ids": [...], "output_length": tokens}``, optionally with ``cache_salt`` and
  ``lora``: re-chunked with kvtier's own chunk keys, so blocks are what the store would key.
- Text: ``{"timestamp": ms, "prompt": "...", "output_length": tokens}``: tokenized first (needs a tokenizer).

Every request keeps its blocks as small integers (ids interned per trace) and how many of them are whole:
kvtier never stores a partial trailing chunk, so only whole blocks are ever cached.

A line with an empty prompt (``input_length: 0``, empty ``token_ids``, or a prompt that tokenizes to nothing: an
agent's call with no prompt) looks up nothing, so it is skipped and counted (``Trace.skipped_empty``) rather than
refusing the whole trace; ``strict=True`` refuses it instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from kvtier.errors import KVTierError
from kvtier.keys import Namespace, chunk_keys

TRACE_MODEL = "kvtier-trace"  # the namespace model of token traces: keys only need to agree within a trace


class TraceError(KVTierError, ValueError):
    """A trace line is malformed: the message names the file, the line and the field."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    blocks: tuple[int, ...]  # every block of the prompt, the partial trailing one included
    whole: int  # how many leading blocks are whole (cacheable)


@dataclasses.dataclass(frozen=True)
class Trace:
    """A trace's requests in arrival order, with the block size their ids were cut at."""

    requests: tuple[Request, ...]
    block_tokens: int
    source: str
    skipped_empty: int = 0  # lines with an empty prompt, left out (see the module docstring)

    @property
    def accesses(self) -> int:
        """Block lookups: every block of every prompt (what a hit ratio divides by)."""
        return sum(len(r.blocks) for r in self.requests)

    @property
    def distinct_blocks(self) -> int:
        """Distinct whole blocks: the capacity at which nothing is ever evicted."""
        return len({b for r in self.requests for b in r.blocks[:r.whole]})


def load_trace(path: str | Path, block_tokens: int = 512,
               tokenizer: Callable[[str], Sequence[int]] | None = None, strict: bool = False) -> Trace:
    """Read a JSONL trace; raises :class:`TraceError` naming the line and field of the first bad line (with
    ``strict``, a line with an empty prompt is one; without, it is skipped and counted)."""
    if block_tokens < 1:
        raise TraceError(f"block_tokens: must be at least 1, got {block_tokens}")
    path = Path(path)
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror or exc}") from exc
    ids: dict[object, int] = {}
    requests: list[Request] = []
    skipped = 0
    with handle:
        last_ts = -math.inf
        for number, line in _lines(handle, path):
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
            # before a line is skipped: a skipped line is still a line of the trace, in its order
            timestamp = _number(row, "timestamp", where)
            if timestamp < last_ts:
                raise TraceError(f"{where}: timestamp: {timestamp} is before the previous line's {last_ts}; a "
                                 "trace is in arrival order")
            last_ts = timestamp
            request = _request(row, timestamp, where, block_tokens, ids, tokenizer, strict)
            if request is None:
                skipped += 1
            else:
                requests.append(request)
    if not requests:
        raise TraceError(f"{path}: the trace has no requests" + (
            f" ({skipped} line{'' if skipped == 1 else 's'} with an empty prompt skipped)" if skipped else ""))
    return Trace(tuple(requests), block_tokens, str(path), skipped)


def agent_trace(requests: int = 1500, tenants: int = 4, sessions: int = 4, block_tokens: int = 256,
                system_blocks: int = 8, added_tokens: tuple[int, int] = (100, 1500), longest_blocks: int = 80,
                seed: int = 0) -> Trace:
    """A synthetic multi-tenant agent trace: ``sessions`` sessions run at once, each call of one (chosen at
    random) extending that session's previous prompt by ``added_tokens`` (uniform) of new input; a session
    starts from its tenant's system prompt (2 to ``system_blocks`` blocks, shared by the tenant's sessions)
    and, once past ``longest_blocks`` whole blocks, ends and a new one starts. Seeded: the same arguments give
    the same trace."""
    rng = random.Random(seed)
    ids = itertools.count()
    systems = [[next(ids) for _ in range(rng.randint(2, max(2, system_blocks)))] for _ in range(tenants)]

    def start() -> tuple[list[int], int]:  # (whole blocks, tokens after them)
        return list(rng.choice(systems)), rng.randrange(block_tokens)

    live = [start() for _ in range(sessions)]
    out = []
    for i in range(requests):
        s = rng.randrange(sessions)
        whole, tail = live[s]
        tokens = tail + rng.randint(*added_tokens)
        whole = whole + [next(ids) for _ in range(tokens // block_tokens)]
        tail = tokens % block_tokens
        blocks = tuple(whole) + ((next(ids),) if tail else ())
        out.append(Request(float(i), len(whole) * block_tokens + tail, 1, blocks, len(whole)))
        live[s] = start() if len(whole) > longest_blocks else (whole, tail)
    return Trace(tuple(out), block_tokens, f"agent_trace(seed={seed})")


def _lines(handle, path: Path) -> Iterator[tuple[int, str]]:
    try:
        for number, line in enumerate(handle, 1):
            if line.strip():
                yield number, line
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _request(row: dict, timestamp: float, where: str, block_tokens: int, ids: dict[object, int],
             tokenizer: Callable[[str], Sequence[int]] | None, strict: bool) -> Request | None:
    """The line's request; None for an empty prompt unless ``strict`` (then an error). Every field is checked
    first: a skipped line is skipped for its empty prompt, never for a fault."""
    output = _count(row, "output_length", where, minimum=0)
    kinds = [k for k in ("hash_ids", "token_ids", "prompt") if k in row]
    if len(kinds) != 1:
        raise TraceError(f"{where}: needs exactly one of hash_ids (with input_length), token_ids or prompt; "
                         f"got {kinds or 'none'}")
    if kinds[0] == "hash_ids":
        length = _count(row, "input_length", where, minimum=0)
        raw = row["hash_ids"]
        if not isinstance(raw, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in raw):
            raise TraceError(f"{where}: hash_ids: expected a list of integers")
        if len(raw) != -(-length // block_tokens):
            raise TraceError(f"{where}: hash_ids: {len(raw)} ids for input_length {length}; blocks of "
                             f"{block_tokens} tokens need {-(-length // block_tokens)} (is --block-tokens right?)")
        if len(set(raw)) != len(raw):
            raise TraceError(f"{where}: hash_ids: an id repeats; prefix-chained ids never do")
        if length == 0:  # and no ids, checked above
            _empty("input_length", where, strict)
            return None
        keys: list[object] = list(raw)
        whole = length // block_tokens
    else:
        if kinds[0] == "prompt":
            if not isinstance(row["prompt"], str):
                raise TraceError(f"{where}: prompt: expected a string")
            if tokenizer is None:
                raise TraceError(f"{where}: prompt: a text trace needs a tokenizer (--tokenizer MODEL_DIR)")
            tokens = list(tokenizer(row["prompt"]))
        else:
            tokens = row["token_ids"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                       and 0 <= t < 2**63 for t in tokens):
                raise TraceError(f"{where}: token_ids: expected a list of integers in [0, 2**63)")
        for field in ("cache_salt", "lora"):
            if row.get(field) is not None and not isinstance(row[field], str):
                raise TraceError(f"{where}: {field}: expected a string")
        if not tokens:
            _empty(kinds[0], where, strict)
            return None
        namespace = Namespace(TRACE_MODEL, "bfloat16", lora=row.get("lora"), cache_salt=row.get("cache_salt"))
        keys = list(chunk_keys(namespace, tokens, block_tokens))
        length = len(tokens)
        whole = len(keys)
        if length % block_tokens:  # the partial tail: its own key, never shared (it is never stored)
            keys.append(("tail", where))
    blocks = tuple(ids.setdefault(k, len(ids)) for k in keys)
    return Request(timestamp, length, output, blocks, whole)


def _empty(field: str, where: str, strict: bool) -> None:
    """An empty prompt: with ``strict`` refused, in the same words for every kind of line; else the caller skips it
    (returns None)."""
    if strict:
        raise TraceError(f"{where}: {field}: an empty prompt (without --strict such lines are skipped)")


def _number(row: dict, field: str, where: str) -> float:
    value = row.get(field)
    if isinstance(value, int) and not isinstance(value, bool) and value > 2**53:
        raise TraceError(f"{where}: {field}: {value} is too large")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: {field}: expected a number >= 0, got {value!r}")
    return float(value)


def _count(row: dict, field: str, where: str, minimum: int) -> int:
    value = row.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{where}: {field}: expected an integer >= {minimum}, got {value!r}")
    return value

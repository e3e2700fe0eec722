"""What both sides of the peer benchmark share: shapes, the seeded KV, token batches and the worker protocol.

A worker (``_kvtier_side.py`` or ``_lmcache_side.py``) runs one group of operations for one system in a process of
its own and writes its timings as JSON to ``--out``; ``bench_lmcache.py`` starts the workers and compares them.
Both sides get the same bytes: kvtier in its canonical layout ``[layers, 2, kv_heads, tokens, head_dim]``, LMCache
in its ``KV_2LTD`` layout ``[2, layers, tokens, kv_heads * head_dim]`` (the same tensor, permuted before timing),
so neither pays for a layout change the other does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CHUNK = 256
SEED = 20261130
# Batches have distinct tokens, so no two share a chunk (both systems key chunks by token prefix): the warm-up is
# batch 0, timed round i stores and retrieves batch 1 + i. A worker's time for an operation is its rounds' median.
WARMUP_BATCH = 0
ROUNDS = 3
WORKER_DEADLINE_S = 120


def timed_batches() -> range:
    return range(1, 1 + ROUNDS)


@dataclasses.dataclass(frozen=True)
class Shape:
    """One model's KV for one tensor-parallel rank, and how many 256-token chunks a batch holds."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    chunks: int
    note: str

    @property
    def tokens(self) -> int:
        return self.chunks * CHUNK

    @property
    def chunk_bytes(self) -> int:
        return self.layers * 2 * self.kv_heads * CHUNK * self.head_dim * 2  # bf16

    @property
    def batch_bytes(self) -> int:
        return self.chunk_bytes * self.chunks


SHAPES = {
    s.name: s for s in (
        Shape("SmolLM2-135M", 30, 3, 64, 32, "30 layers, 3 KV heads, head_dim 64, bf16: the whole model (TP=1)"),
        Shape("70B-class", 80, 2, 128, 8, "80 layers, 8 KV heads, head_dim 128, bf16, one rank of TP=4 "
                                          "(2 KV heads)"),
    )
}


def make_kv(shape: Shape) -> torch.Tensor:
    """The seeded KV of one batch in kvtier's layout ``[layers, 2, kv_heads, tokens, head_dim]``."""
    gen = torch.Generator().manual_seed(SEED)
    return torch.randn(shape.layers, 2, shape.kv_heads, shape.tokens, shape.head_dim,
                       generator=gen).to(torch.bfloat16)


def lmcache_layout(kv: torch.Tensor) -> torch.Tensor:
    """The same bytes in LMCache's ``KV_2LTD`` layout ``[2, layers, tokens, kv_heads * head_dim]``."""
    layers, _, heads, tokens, dim = kv.shape
    return kv.permute(1, 0, 3, 2, 4).reshape(2, layers, tokens, heads * dim).contiguous()


def batch_tokens(batch: int, shape: Shape) -> torch.Tensor:
    """Token ids of batch ``batch`` (an int64 tensor, as engines hold them): distinct between batches, the same
    on both sides."""
    base = 1_000 + batch * 10_000_000
    return torch.arange(base, base + shape.tokens, dtype=torch.int64)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``torch.equal`` on bf16 would let -0.0 equal 0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    got = fn()
    return time.perf_counter() - start, got


@dataclasses.dataclass
class Result:
    """What one worker reports: seconds per timed operation (each round's, and their median), and what it saw."""

    system: str
    group: str
    shape: str
    samples: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    found_tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    verified: dict[str, bool] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    def time(self, op: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` as one timed round of ``op``; returns what it returned."""
        seconds, got = timed(fn)
        self.samples.setdefault(op, []).append(seconds)
        return got

    def found(self, op: str, tokens: int) -> None:
        """Record how many tokens ``op`` found (the least over the rounds)."""
        self.found_tokens[op] = min(tokens, self.found_tokens.get(op, tokens))

    def check(self, op: str, got: torch.Tensor, want: torch.Tensor, found: int, tokens: int) -> None:
        """Record what ``op`` returned; a retrieve that returns other bytes than were stored fails the run.

        Finding nothing is recorded (LMCache's disk backend after a restart), not failed; finding part is a failure.
        """
        self.found(op, found)
        if found == 0:
            self.verified[op] = False
            return
        assert found == tokens, f"{self.system} {op}: found {found} of {tokens} tokens"
        assert same_bytes(got, want), f"{self.system} {op}: the retrieved KV differs from the stored KV"
        self.verified[op] = self.verified.get(op, True)

    def write(self, path: Path) -> None:
        seconds = {op: statistics.median(values) for op, values in self.samples.items()}
        path.write_text(json.dumps({**dataclasses.asdict(self), "seconds": seconds}, indent=1))


def parse_args(system: str, groups: tuple[str, ...]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=f"one {system} worker of benchmarks/peers/bench_lmcache.py")
    parser.add_argument("--group", required=True, choices=groups)
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--out", required=True, type=Path, help="where to write the result JSON")
    parser.add_argument("--dir", type=Path, help="the filesystem groups' directory")
    parser.add_argument("--url", help="the Redis groups' server: redis://host:port (kvtier, LMCache's redis-py "
                                      "connector) or resp://host:port (LMCache's C++ client)")
    args = parser.parse_args()
    # A worker that hangs (a lost completion in a client) prints every thread's stack and exits, failing its run.
    faulthandler.dump_traceback_later(WORKER_DEADLINE_S, exit=True)
    return args

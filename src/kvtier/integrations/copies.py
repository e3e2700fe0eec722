"""Copies between an engine's blocks and kvtier's DRAM, cut by layers over the cores the model is not computing
on (the vLLM connector's worker uses it).

On CPU, vLLM computes on the cores it binds (one of two here: the other is left to its scheduler and to kvtier),
and while a step's load runs in ``start_load_kv``, or its save in ``wait_for_save``, the model waits on it. A
load's copy into the paged blocks is one strided copy per layer and run of blocks (see
:mod:`kvtier.integrations.layouts`), and torch releases the GIL while it copies: so the layers are split between
the engine's thread and helper threads on the spare cores, each copying its own layers, all at once (a 4K-token
load of SmolLM2 from DRAM into vLLM's CPU layout: 0.52 of a one-thread plain copy's speed on one thread, 0.95 on
two; ``benchmarks/bench_store.py``). On a GPU the copies are the device's (no split).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kvtier import threads

MAX_HELPERS = 3  # beyond this a host's memory bandwidth, not its cores, bounds a copy


def spare_cores() -> int:
    """Cores to split a copy over beside the engine's thread: none where torch copies on several threads (its own
    copies are spread over them already, and a helper's single-threaded share would be the slowest); else those
    kvtier's threads were placed on (vLLM's API-server worker, :func:`kvtier.threads.spare_cpus`), else this
    thread's CPUs less the one it computes on (an in-process engine)."""
    if torch.get_num_threads() != 1:
        return 0
    placed = threads.placed_on()
    if placed is not None:
        return len(placed)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux: no spare core known
        return 0
    return max(0, cpus - 1)


class LayerCopies:
    """Runs a copy over ``layers`` layers on the calling thread and ``helpers`` helper threads at once, each on a
    contiguous range of them."""

    def __init__(self, helpers: int) -> None:
        self.helpers = max(0, min(helpers, MAX_HELPERS))
        self._pool = threads.DaemonPool("kvtier-copy", self.helpers) if self.helpers else None

    def run(self, copy: Callable[[slice], None], layers: int) -> None:
        """``copy(layer_slice)`` for slices covering ``range(layers)``; returns when every one has ended, and
        raises the first failure only then (no helper still writes into the blocks once a failed copy is
        reported and the engine recomputes them)."""
        parts = min(self.helpers + 1, layers)
        if self._pool is None or parts <= 1:
            _in_inference_mode(copy, slice(0, layers))
            return
        bounds = [layers * i // parts for i in range(parts + 1)]
        slices = [slice(bounds[i], bounds[i + 1]) for i in range(parts)]
        futures: list[Future[None]] = []
        errors: list[BaseException] = []
        try:
            for s in slices[1:]:  # one at a time: those queued before a submit that fails are waited on below
                futures.append(self._pool.submit(functools.partial(_in_inference_mode, copy, s)))  # noqa: PERF401 as above
            _in_inference_mode(copy, slices[0])
        except BaseException as exc:  # noqa: BLE001 raised once the helpers' copies have ended
            errors.append(exc)
        for future in futures:
            failure = future.exception()  # waits
            if failure is not None:
                errors.append(failure)
        if errors:
            raise errors[0]


    def close(self) -> None:
        """Let the helper threads end once their copies are done (never waits)."""
        if self._pool is not None:
            self._pool.close()


def _in_inference_mode(copy: Callable[[slice], None], layers: slice) -> None:
    """``copy(layers)`` in torch's inference mode, which is per thread: vLLM makes its caches (inference tensors, or
    views taken in its steps) in it, and they are written in place only within it; a normal tensor may be written
    in it too."""
    with torch.inference_mode():
        copy(layers)

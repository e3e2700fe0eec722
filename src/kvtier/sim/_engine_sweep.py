"""``kvtier calibrate``'s engine sweeps, in a process of their own (vLLM, in-process engine, CPU or GPU).

Usage: ``python -m kvtier.sim._engine_sweep JOB_JSON OUT_JSON``. The job names the model, its dtype and the grids:

- prefill: for each (cached, new) pair, a fresh random prefix of ``cached`` tokens is computed once (vLLM's own
  prefix cache keeps it), then the prefix plus ``new`` tokens is timed to its first token;
- hit floor: a prompt asked again exactly (vLLM recomputes only its last block);
- decode: ``batch`` requests generating ``steps`` tokens against the same requests generating one: the
  difference over ``steps - 1`` is one decode step at that batch size.

Prompts are random token ids (timing does not depend on content), fresh for every measurement so that nothing is
cached unless the sweep cached it on purpose. A prefill point and a hit floor are measured ``min_repeats`` times,
and again until most measurements lie within ``spread`` of their median (at most ``max_repeats``); the point is
their median, with every measurement kept (``times``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BLOCK = 128


def log(msg: str) -> None:
    print(f"calibrate: {msg}", file=sys.stderr, flush=True)


def repeated(measure: Callable[[], float], least: int, most: int, spread: float) -> list[float]:
    """``least`` measurements, and more (up to ``most``) until most of them lie within ``spread`` of their
    median: on a noisy machine a slow run is outvoted instead of becoming the point."""
    times: list[float] = []
    while len(times) < least or (len(times) < most and not _agree(times, spread)):
        times.append(measure())
    return times


def _agree(times: list[float], spread: float) -> bool:
    middle = statistics.median(times)
    return 2 * sum(abs(t - middle) <= spread * middle for t in times) > len(times)


def die_with(parent: int) -> None:
    """End this process when ``parent`` (``kvtier calibrate``) ends: killed (SIGKILL runs no cleanup, e.g. a
    timeout's), the sweep would hold a core for minutes computing points nobody reads. On Linux the kernel sends
    SIGKILL at the parent's end (when the thread that started this process ends: calibrate's main thread, which
    waits for it); elsewhere only a parent gone before this call is seen. vLLM's own engine processes, when
    multiprocessing is turned on, are not covered."""
    if sys.platform == "linux":
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            failed = libc.prctl(pr_set_pdeathsig, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
                                ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0
        except (OSError, AttributeError):  # no libc to load (a static build): the check below only
            failed = True
        if failed:
            log(f"cannot ask to end with calibrate (prctl: errno {ctypes.get_errno()}); a killed calibrate leaves "
                "this process running")
    if os.getppid() != parent:  # it ended before the line above took effect
        log(f"calibrate (pid {parent}) is gone; the sweep stops")
        os._exit(1)


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    if "parent" in job:
        die_with(job["parent"])
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(job.get("seed", 0))
    low, high = 1000, max(1001, job["vocab_size"] - 1000)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(low, high, n)]

    longest = max(max(c + n for c, n in job["prefill"]), max(job["hit_floor"]))
    max_len = -(-(longest + 8) // BLOCK) * BLOCK
    started = time.perf_counter()
    llm = LLM(model=job["model"], enforce_eager=True, enable_prefix_caching=True, dtype=job["dtype"],
              max_model_len=max_len, max_num_batched_tokens=max_len, block_size=BLOCK,
              num_gpu_blocks_override=3 * (max_len // BLOCK) + max(job["decode_batches"]) * 2 + 8,
              gpu_memory_utilization=0.3, max_num_seqs=max(256, max(job["decode_batches"])))
    log(f"engine up in {time.perf_counter() - started:.1f} s (max_model_len {max_len})")

    def run(prompts: list[list[int]], steps: int) -> float:
        start = time.perf_counter()
        asked = [TokensPrompt(prompt_token_ids=p) for p in prompts]  # type: ignore[typeddict-item]  # vLLM's NotRequired (3.11)
        llm.generate(asked, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    run([tokens(64)], 2)  # first-call costs (kernels, allocations) are nobody's prefill
    out: dict[str, Any] = {"prefill": [], "hit_floor": [], "decode": []}  # and "vllm": its version
    repeats = job["repeats"]  # decode's
    least = max(1, job.get("min_repeats", repeats))
    bounds = (least, max(least, job.get("max_repeats", least)), job.get("spread", 0.25))

    def prefill(cached: int, new: int) -> float:
        prefix = tokens(cached)
        if cached:
            run([prefix], 1)
        return run([prefix + tokens(new)], 1)

    def hit(length: int) -> float:
        prompt = tokens(length)
        run([prompt], 1)
        return run([prompt], 1)

    for i, (cached, new) in enumerate(job["prefill"], 1):
        times = repeated(lambda: prefill(cached, new), *bounds)  # noqa: B023 (called at once)
        out["prefill"].append({"cached": cached, "new": new, "seconds": statistics.median(times), "times": times})
        log(f"prefill {i}/{len(job['prefill'])}: {new} new tokens after {cached} cached: "
            f"{statistics.median(times):.3f} s ({len(times)} measurements)")
    for length in job["hit_floor"]:
        times = repeated(lambda: hit(length), *bounds)  # noqa: B023 (called at once)
        out["hit_floor"].append({"tokens": length, "seconds": statistics.median(times), "times": times})
        log(f"hit floor: {length} tokens asked again: {statistics.median(times):.3f} s ({len(times)} measurements)")
    steps = job["decode_steps"]
    for batch in job["decode_batches"]:
        per_step = []
        for _ in range(repeats):
            one = run([tokens(job["decode_prompt"]) for _ in range(batch)], 1)
            many = run([tokens(job["decode_prompt"]) for _ in range(batch)], steps)
            per_step.append(max(many - one, 0.0) / (steps - 1))
        out["decode"].append({"batch": batch, "step_seconds": statistics.median(per_step)})
        log(f"decode: batch {batch}: {statistics.median(per_step) * 1000:.1f} ms per step")
    import vllm

    out["vllm"] = vllm.__version__
    Path(sys.argv[2]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One benchmark phase: one vLLM engine (in-process, CPU) in a process of its own.

Usage: ``python -m kvtier.bench.phase JOB_JSON PHASE OUT_JSON``. vLLM keeps one KV connector per process, so
every engine configuration gets a fresh process; what is left on disk is what the next phase may find.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.bench import pairs


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def engine(job: dict, kvtier: bool, blocks: int):
    from vllm import LLM

    args: dict[str, Any] = {"model": job["model"], "enforce_eager": True, "enable_prefix_caching": True,
                            "dtype": "bfloat16", "max_model_len": job["max_model_len"],
                            "num_gpu_blocks_override": blocks, "block_size": job["block_tokens"],
                            "gpu_memory_utilization": 0.3,
                            "max_num_batched_tokens": job["max_model_len"]}
    if kvtier:
        args["kv_transfer_config"] = {"kv_connector": "KVTierConnector",
                                      "kv_connector_module_path": "kvtier.integrations.vllm",
                                      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                      "kv_connector_extra_config": {"config": job["store"],
                                                                    "store_tails": job.get("store_tails", True)}}
    return LLM(**args)


def ttft(llm, tokens: list[int]) -> float:
    """Seconds until the first output token: one request alone, one output token."""
    return _generate(llm, tokens)[0]


def generate_one(llm, tokens: list[int]) -> tuple[float, int]:
    """:func:`ttft`, and the prompt's tokens vLLM did not compute (its own prefix cache's and its connector's)."""
    seconds, out = _generate(llm, tokens)
    return seconds, out[0].num_cached_tokens or 0


def _generate(llm, tokens: list[int]) -> tuple[float, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=tokens)  # type: ignore[typeddict-item]  # vLLM's NotRequired (3.11)
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - start, out


def run_requests(llm, job: dict, rounds: list[int], label: str, before=None) -> list[float]:
    times = []
    for req in job["requests"]:
        if req["round"] not in rounds:
            continue
        if before is not None:
            before()
        times.append(ttft(llm, req["tokens"]))
        log(f"{label:>12}: round {req['round']} doc {req['doc']}: {len(req['tokens'])} tokens, "
            f"TTFT {times[-1]:.3f} s")
    return times


def run_docs(llm, job: dict, label: str, before=None) -> list[float]:
    """Each document alone, no question after it: a prompt asked again exactly (its chunks were stored with the
    first question)."""
    times = []
    for d, doc in enumerate(job["docs"]):
        if before is not None:
            before()
        times.append(ttft(llm, doc))
        log(f"{label:>12}: doc {d}: {len(doc)} tokens, TTFT {times[-1]:.3f} s")
    return times


def disk_then_dram(llm, store, job: dict,
                   rounds: list[int]) -> tuple[list[float], list[float], list[int]]:
    """Each request twice in a row, vLLM's own prefix cache emptied before each: from the disk (kvtier's DRAM
    emptied first), then from kvtier's DRAM, where the disk hit left its chunks. The second is the first
    without the disk's read: the same prompt computed by the same process a moment later. Processes differ in
    how fast they compute by as much as a disk read costs, so what a disk read costs is best known as the
    difference between the two in one process. Each pair is checked to have been what it stands for (chunks
    from the disk only, then as many from DRAM only, none missing; RuntimeError if not); the third list is how
    many, by prompt (the orchestrator checks the plain and the sealed process loaded the same)."""
    drop, tier = _dropper(store), store.tiers[0].name
    disk: list[float] = []
    dram: list[float] = []
    chunks: list[int] = []
    for req in job["requests"]:
        if req["round"] not in rounds:
            continue
        served = []
        for times, before, source in ((disk, drop, "disk"), (dram, None, "DRAM")):
            if before is not None:
                before()
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not empty its prefix cache")
            counts = _served(store, tier)
            times.append(ttft(llm, req["tokens"]))
            served.append(tuple(after - was for after, was in zip(_served(store, tier), counts)))
            log(f"{'reread ' + source:>12}: round {req['round']} doc {req['doc']}: {len(req['tokens'])} tokens, "
                f"TTFT {times[-1]:.3f} s")
        (disk_dram, disk_tier, disk_missed), (dram_dram, dram_tier, dram_missed) = served
        if disk_dram or not disk_tier or disk_missed or dram_tier or dram_missed or dram_dram != disk_tier:
            raise RuntimeError(f"round {req['round']} doc {req['doc']}: chunks from DRAM, {tier}, missing: "
                               f"{served[0]} from the disk, then {served[1]} from DRAM; expected (0, n, 0), "
                               "then (n, 0, 0)")
        chunks.append(int(disk_tier))
    return disk, dram, chunks


def _served(store, tier: str) -> tuple[float, float, float]:
    """Chunks the store served so far from DRAM and from ``tier``, and chunks it found nowhere."""
    stats = store.stats()
    return (stats["dram"].get("hit_chunks_total", 0.0), stats[tier].get("hit_chunks_total", 0.0),
            stats["_store"].get("miss_chunks_total", 0.0))


def _ask(llm, store, job: dict) -> pairs.Ask:
    """The pairs' view of an in-process engine with kvtier's connector and its store."""
    tier = store.tiers[0].name
    cached = [0]

    def timed(tokens: list[int]) -> float:
        seconds, spared = generate_one(llm, tokens)
        cached[0] += spared
        return seconds

    def reset() -> None:
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not empty its prefix cache")

    return pairs.Ask(ttft=timed, served=lambda: _served(store, tier), cached=lambda: cached[0], reset=reset,
                     drop=_dropper(store), **pairs.units(job))


def _dropper(store):
    """Before a disk hit: every queued write ended, then kvtier's DRAM emptied, so the chunks come from files."""
    def drop() -> None:
        store.flush()
        store.drop_dram()
    return drop


def _loads_by_layers() -> bool:
    """Whether this process's engine copies its loads layer by layer beside the forward pass."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvtier.integrations.vllm import KVTierConnector

    connector = get_kv_transfer_group()
    return isinstance(connector, KVTierConnector) and connector.loads_by_layers


def _hits(job: dict, variant: str, work: Path) -> dict[str, object]:
    """Every document computed and stored, then the pairs of each kind of hit; in the plain phase (``variant``
    ``kvtier``), the bandwidths the floor is computed from. ``encrypted``: every object sealed; a codec's name: the
    tier storing with it, and only the disk (or shared tier) hits measured (a DRAM hit is the same as without)."""
    from kvtier.integrations.vllm import shared_store

    llm = engine(job, True, job["small_blocks"])
    store = shared_store(job["store"])
    assert store is not None
    run_requests(llm, job, [0], "store")  # computes and stores every document
    store.flush()
    where = job.get("secondary", "disk")
    suffix = "" if variant == "kvtier" else f", {variant}"
    kinds = pairs.KINDS if variant in ("kvtier", "encrypted") else ("disk hit",)
    measured = pairs.measure(_ask(llm, store, job), job["docs"], job["suffixes"]["kvtier"], job["pair_rounds"],
                             kinds=kinds, log=log)
    result: dict[str, object] = {"pairs": {f"kvtier, {kind.replace('disk', where)}{suffix}": times
                                           for kind, times in measured.items()}}
    for label, times in measured.items():  # the TTFT table's rows
        result[f"kvtier, {label.replace('disk', where)}{suffix}"] = times["kvtier"]
    if variant == "kvtier":
        nbytes = job["kv_bytes_per_token"] * len(job["docs"][0])
        bandwidth: dict[str, object] = {"bytes": nbytes, **pairs.bandwidths(nbytes, work=work),
                                        "beside_forward": _loads_by_layers()}
        if where != "disk":  # a shared tier: the floor of its hits is its server's wire speed
            from kvtier.store import READ_AHEAD

            chunks = len(job["docs"][0]) // job["store"]["chunk_tokens"]
            bandwidth["wire_readers"] = READ_AHEAD + 1  # those read ahead, and the one the load waits for
            bandwidth["wire"] = pairs.wire(store.tiers[0], nbytes, chunks, READ_AHEAD + 1)
        result["bandwidth"] = bandwidth
    store.flush()
    result["stats"] = store.stats()
    return result


def _restart(job: dict) -> dict[str, object]:
    """A new process on the tier the kvtier phase filled: one pair a document, kvtier's hit first (the document's
    first use here), then vLLM's own."""
    from kvtier.integrations.vllm import shared_store

    llm = engine(job, True, job["small_blocks"])
    store = shared_store(job["store"])
    assert store is not None, "the engine's connector opened the store"
    ttft(llm, job["unique"][0][:256])  # vLLM's first request's own costs, on a prompt kvtier never held
    where = job.get("secondary", "disk")
    label = "kvtier, after restart" if where == "disk" else f"kvtier, {where} hit in a new process"
    measured = pairs.measure(_ask(llm, store, job), job["docs"], job["suffixes"]["restart"], 1, kinds=("disk hit",),
                             log=log, warm=False)
    return {"pairs": {label: measured["disk hit"]}, label: measured["disk hit"]["kvtier"], "stats": store.stats()}


def _noreuse(job: dict, phase: str) -> dict[str, object]:
    """Every prompt unique, in a fresh engine: vLLM alone (``noreuse_plain``), with kvtier (``noreuse_kvtier``) or
    with kvtier storing a prefix only once it comes again (``noreuse_admission``, ``admission.store_after`` 2).
    The engine's start, the first prompt's TTFT (nothing warmed before it), then the throughput of the other
    prompts; with ``noreuse_repeats`` in the job, one of them asked twice more (vLLM's prefix cache emptied before
    each): what its first and second repeat cost."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if phase == "noreuse_admission":
        job = dict(job, store=dict(job["store"], admission={"store_after": 2}))
    start = time.perf_counter()
    llm = engine(job, phase != "noreuse_plain", job["small_blocks"])
    out: dict[str, object] = {"start_s": time.perf_counter() - start, "first_ttft_s": ttft(llm, job["unique"][0])}
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["unique"][1:]]  # type: ignore[typeddict-item]  # vLLM's NotRequired (3.11)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=job["noreuse_output"], temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outs)
    out["throughput"] = tokens / seconds
    log(f"{phase}: started in {out['start_s']:.1f} s, first TTFT {out['first_ttft_s']:.3f} s; {tokens} tokens in "
        f"{seconds:.2f} s: {tokens / seconds:.0f} tokens/s")
    if job.get("noreuse_repeats"):
        repeats = []
        for _ in range(2):
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM did not empty its prefix cache")
            repeats.append(generate_one(llm, job["unique"][1])[0])
        out["repeat_ttft_s"] = repeats
        log(f"{phase}: a prompt asked again: TTFT {repeats[0]:.3f} s, a third time {repeats[1]:.3f} s")
    return out


def main() -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vLLM is imported: an in-process engine
    job = json.loads(Path(sys.argv[1]).read_text())
    phase, out_path = sys.argv[2], Path(sys.argv[3])
    result: dict[str, object] = {}
    later = list(range(1, job["rounds"]))
    if phase == "baseline":  # vLLM alone, its KV memory smaller than the documents together
        llm = engine(job, False, job["small_blocks"])
        run_requests(llm, job, [0], "warm-up")
        result["vLLM, recompute"] = run_requests(llm, job, later, "baseline")
    elif phase == "engine_hit":  # vLLM alone with room for every document: its own prefix-cache hits
        llm = engine(job, False, job["large_blocks"])
        run_requests(llm, job, [0], "warm-up")
        result["vLLM prefix-cache hit"] = run_requests(llm, job, later, "engine hit")
        result["vLLM prefix-cache hit, exact repeat"] = run_docs(llm, job, "engine hit, exact")
    elif phase == "api_server":
        from kvtier.bench import server

        result.update(server.run(job, out_path.parent, log))
    elif phase in ("kvtier", "encrypted", "fp8", "k16v8"):  # the same, every object sealed, or with a codec
        result.update(_hits(job, phase, out_path.parent))
    elif phase == "reread":  # a new process re-reading a disk an earlier phase wrote: disk hits only
        from kvtier.integrations.vllm import shared_store

        llm = engine(job, True, job["small_blocks"])
        store = shared_store(job["store"])
        assert store is not None
        encrypted = "encryption" in job["store"]
        run_requests(llm, job, [0], f"reread{', encrypted' if encrypted else ''}, warm-up", before=_dropper(store))
        result["disk"], result["dram"], result["chunks"] = disk_then_dram(llm, store, job, later)
        result["sealed"] = encrypted
    elif phase == "restart":  # a new process: every document's first hit comes from what the last one stored
        result.update(_restart(job))
    elif phase in ("noreuse_plain", "noreuse_kvtier", "noreuse_admission", "noreuse_fp8"):  # every prompt unique
        result.update(_noreuse(job, phase))
    else:
        raise ValueError(f"unknown phase {phase!r}")
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Orchestrates ``kvtier bench``: prepares the model and workload, runs each phase in its own process, and
prints TTFT per phase with ratios against vLLM recomputing (same workload, same machine, same run)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtier.bench import pairs
from kvtier.bench.model import prepare_model
from kvtier.bench.server import inprocess_env, server_env
from kvtier.bench.workload import documents, requests, suffixes

BLOCK = 128
# documents, tokens per document, rounds (questions per document), unique prompts, output tokens, the encryption's
# re-reading process pairs, and the rounds of hit pairs (kvtier.bench.pairs) per document and kind
PROFILES = {
    "quick": {"docs": 3, "doc_tokens": 2048, "rounds": 2, "unique": 4, "noreuse_output": 16, "reread_pairs": 1,
              "pair_rounds": 2},
    "full": {"docs": 4, "doc_tokens": 4096, "rounds": 3, "unique": 5, "noreuse_output": 32, "reread_pairs": 3,
             "pair_rounds": 4},
}
# fp8, k16v8: the kvtier phase again, its tier storing with that codec (disk hits only); noreuse_fp8: the no-reuse
# phase with every write encoded to fp8 (on the cascade writer threads)
CODEC_PHASES = ("fp8", "k16v8")
PHASES = ("baseline", "kvtier", "restart", "encrypted", *CODEC_PHASES, "engine_hit", "api_server", "noreuse_plain",
          "noreuse_kvtier", "noreuse_fp8")
# With a shared tier the question is how fast its hits are; the no-reuse overhead is measured on the disk setup.
SHARED_PHASES = ("baseline", "kvtier", "restart", *CODEC_PHASES, "engine_hit")
LONG_PHASES = ("baseline", "kvtier", "engine_hit")  # --prefix-tokens: the hit ratios at another prefix length


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"mean": statistics.fmean(ordered), "p50": statistics.median(ordered),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "n": len(ordered)}


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


@contextlib.contextmanager
def _secondary_tier(kind: str | None, work: Path) -> Iterator[dict]:
    """The store's one secondary tier: the local disk, or a shared tier on a server started here."""
    if kind is None:
        yield {"type": "filesystem", "path": str(work / "kv")}
        return
    from kvtier.testing import servers

    server: Any
    if kind == "s3":
        server = servers.S3Server(work / "s3").start()
    elif kind == "mooncake":
        server = servers.MooncakeServer(work / "mooncake", segment="4GB").start()
    elif kind == "redis-cluster":
        server = servers.RedisCluster(work / "redis-cluster", maxmemory="2gb").start()
    else:
        server = servers.RedisServer(work / "redis", maxmemory="4gb").start()
    log(f"{kind} server started on loopback")
    try:
        yield {"type": "redis" if kind == "redis-cluster" else kind, "name": kind, **server.tier_options()}
    finally:
        server.stop()


def run(quick: bool, json_path: Path | None, work_dir: Path | None, shared: str | None = None,
        prefix_tokens: int | None = None, chunk_tokens: int = 256, tails: bool = True) -> int:
    profile: dict[str, Any] = dict(PROFILES["quick" if quick else "full"], name="quick" if quick else "full",
                                   chunk_tokens=chunk_tokens, tails=tails)
    phases: tuple[str, ...] = SHARED_PHASES if shared else PHASES
    if prefix_tokens is not None:  # 3 documents asked twice: vLLM's memory of 1.5 documents still cannot keep them
        profile.update(doc_tokens=prefix_tokens, docs=3, rounds=2, unique=0, pair_rounds=2,
                       name=f"{prefix_tokens}-token prefixes")
        phases = tuple(p for p in phases if p in LONG_PHASES)
    model = prepare_model()
    work = Path(work_dir or Path.cwd() / "results" / "bench-work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with _secondary_tier(shared, work) as tier:
        return _run_phases(make_job(model, profile, tier, shared), work, profile, json_path, phases)


def make_job(model: Path, profile: dict, tier: dict, shared: str | None = None) -> dict:
    """What every phase process reads: the engine's sizes, the store's config with ``tier`` its secondary, the
    documents, their questions and the pairs' fresh suffixes, for ``profile``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    docs = documents(tokenizer, profile["docs"] + profile["unique"], profile["doc_tokens"])
    reqs = requests(tokenizer, docs[:profile["docs"]], profile["rounds"])
    max_len = profile["doc_tokens"] + 2 * BLOCK
    job = _job(model, profile, reqs, docs, max_len, -(-max_len // BLOCK), tier, shared)
    job.update(pair_rounds=profile["pair_rounds"], kv_bytes_per_token=pairs.kv_bytes_per_token(model),
               suffixes=_suffixes(tokenizer, profile["docs"], profile["pair_rounds"],
                                  len(reqs[0].tokens) - profile["doc_tokens"]))
    return job


def _suffixes(tokenizer, docs: int, rounds: int, length: int) -> dict[str, list[list[int]]]:
    """Fresh suffixes of ``length`` tokens (the questions' length) for each phase's pairs, none shared between
    phases that see the same store: the kvtier phase stores its prompts' tails, which a later process on its disk
    would otherwise find (the encrypted phase has a disk of its own, and the API server's config is DRAM-only)."""
    needs = {"kvtier": pairs.suffixes_needed(docs, rounds), "restart": pairs.suffixes_needed(docs, 1, ("disk hit",)),
             "api_server": pairs.suffixes_needed(docs, rounds, ("DRAM hit",))}
    every = suffixes(tokenizer, needs["kvtier"] + needs["restart"], length)
    return {"kvtier": every[:needs["kvtier"]], "restart": every[needs["kvtier"]:],
            "api_server": every[:needs["api_server"]]}


def _job(model: Path, profile: dict, reqs: list, docs: list, max_len: int, per_doc: int, tier: dict,
         shared: str | None) -> dict:
    return {
        "model": str(model), "rounds": profile["rounds"], "max_model_len": max_len, "block_tokens": BLOCK,
        # vLLM's own KV memory holds about 1.5 documents: cycling through all of them defeats it.
        "small_blocks": max(per_doc + 1, int(1.5 * per_doc)),
        "large_blocks": per_doc * profile["docs"] * profile["rounds"] + 8,
        "store": {"chunk_tokens": profile["chunk_tokens"], "dram": {"capacity_bytes": "2GiB"}, "tiers": [tier]},
        "store_tails": profile["tails"],
        "secondary": shared or "disk",
        "requests": [{"doc": r.doc, "round": r.question, "tokens": r.tokens} for r in reqs],
        "docs": docs[:profile["docs"]],
        "unique": docs[profile["docs"]:], "noreuse_output": profile["noreuse_output"],
    }


def _run_phases(job: dict, work: Path, profile: dict, json_path: Path | None, phases: tuple[str, ...]) -> int:
    (work / "job.json").write_text(json.dumps(job))
    log(f"{profile['docs']} documents x {profile['doc_tokens']} tokens, {profile['rounds']} questions each, "
        f"kvtier chunks of {job['store']['chunk_tokens']} tokens{'' if job['store_tails'] else ', no tails'}; "
        f"vLLM KV memory: {job['small_blocks']} blocks of {BLOCK} tokens")
    results: dict[str, object] = {}
    for phase in phases:
        log(f"phase {phase}")
        job_path = work / "job.json"
        if phase == "noreuse_kvtier":  # a store of its own, so nothing from earlier phases can hit
            job["store"]["tiers"][0]["path"] = str(work / "kv-noreuse")
            job_path.write_text(json.dumps(job))
        elif phase == "encrypted":  # the kvtier phase again, on a disk of its own with every object sealed
            job_path = work / "job-encrypted.json"
            job_path.write_text(json.dumps(_encrypted(job, work)))
        elif phase in CODEC_PHASES or phase == "noreuse_fp8":  # on storage of its own, its tier with a codec
            job_path = work / f"job-{phase}.json"
            job_path.write_text(json.dumps(_coded(job, work, phase)))
        start = time.perf_counter()
        out = work / f"{phase}.json"
        if not _run_phase(job_path, phase, out, work / f"{phase}.log"):
            return 1
        results[phase] = json.loads(out.read_text())
        log(f"phase {phase} done in {time.perf_counter() - start:.0f} s")
    if "encrypted" in results and job["secondary"] == "disk":
        # The encryption's cost again, from processes that only re-read the two disks, plain and sealed in turn:
        # one phase each (above) differ by as much as they measure, so pairs of them, alternating.
        pairs: dict[str, list[dict[str, list[float]]]] = {"plain": [], "sealed": []}
        plain = work / "job-reread.json"  # the kvtier phase's disk (job.json names the no-reuse phase's by now)
        plain.write_text(json.dumps(dict(job, store=dict(job["store"], tiers=[
            dict(job["store"]["tiers"][0], path=str(work / "kv"))]))))
        for i in range(profile.get("reread_pairs", 1)):
            order = (("plain", plain), ("sealed", work / "job-encrypted.json"))
            for kind, path in order if i % 2 == 0 else order[::-1]:  # which runs first alternates
                log(f"phase reread ({kind}, pair {i + 1})")
                out = work / f"reread-{kind}-{i}.json"
                if not _run_phase(path, "reread", out, work / f"reread-{kind}-{i}.log"):
                    return 1
                got = json.loads(out.read_text())  # (phase.disk_then_dram)
                if got["sealed"] != (kind == "sealed"):
                    raise RuntimeError(f"{out}: a {'sealed' if got['sealed'] else 'plain'} store, not {kind}")
                pairs[kind].append({"disk": got["disk"], "dram": got["dram"], "chunks": got["chunks"]})
            if pairs["plain"][-1]["chunks"] != pairs["sealed"][-1]["chunks"]:
                log(f"phase reread, pair {i + 1}: the plain and the sealed process loaded different chunks by prompt "
                    f"({pairs['plain'][-1]['chunks']} and {pairs['sealed'][-1]['chunks']}); not comparable")
                return 1
        results["reread"] = pairs
    return report(results, profile, json_path, job["secondary"])


def _run_phase(job_path: Path, phase: str, out: Path, log_path: Path) -> bool:
    """Run one phase in a process of its own; whether it succeeded (else its log is named)."""
    with open(log_path, "w") as engine_log:  # vLLM logs to stdout: keep it out of the table
        proc = subprocess.run([sys.executable, "-m", "kvtier.bench.phase", str(job_path), phase, str(out)],
                              stdout=engine_log,
                              env={**inprocess_env(),
                                   "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                                   # prefixes beyond the model's 8,192 positions (--prefix-tokens 16384)
                                   "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    if proc.returncode != 0:
        log(f"phase {phase} failed (exit {proc.returncode}); engine log: {log_path}")
    return proc.returncode == 0


def _encrypted(job: dict, work: Path) -> dict:
    """``job`` with its store's objects sealed (a key and a keyring of its own) on a disk of its own."""
    from kvtier.sealing import write_key_file

    write_key_file(str(work / "master.key"))
    store = dict(job["store"], tiers=[dict(job["store"]["tiers"][0], path=str(work / "kv-encrypted"))],
                 encryption={"key": f"file:{work / 'master.key'}", "keyring": str(work / "keyring")})
    return dict(job, store=store)


def _coded(job: dict, work: Path, phase: str) -> dict:
    """``job`` with its tier storing with the phase's codec, on storage of its own (a directory, a key prefix):
    exact objects an earlier phase stored are what a lossy tier's reads accept too."""
    tier = dict(job["store"]["tiers"][0], codec=phase.removeprefix("noreuse_"))
    if tier["type"] == "filesystem":
        tier["path"] = str(work / f"kv-{phase}")
    else:
        tier["prefix" if tier["type"] == "s3" else "key_prefix"] = f"{phase}/"
    return dict(job, store=dict(job["store"], tiers=[tier]))


def _reread(pairs: dict[str, list[dict[str, list[float]]]]) -> dict[str, Any]:
    """The encryption's cost on a disk hit from the alternating re-reading processes (``phase.disk_then_dram``),
    printed, two ways: the TTFT of the sealed disk's hits over the plain one's, pair by pair; and the cost of the
    disk's read alone (a disk hit's TTFT less that of the same prompt from kvtier's DRAM a moment later, in the
    same process: the mean over the prompts, as TTFTs are compared by their means), sealed less plain, added to
    the plain disk hit's TTFT. Processes differ in how fast they compute the same prompt by as much as the target
    allows; the second way compares what encryption changes (the read), the computation taken out within each
    process, and with it whatever a sealed process does slower beside its reads (the first way shows that). The
    verdict is on the median pair of the second way; both are printed."""
    def read_cost(run: dict[str, list[float]]) -> float:
        return statistics.fmean(disk - dram for disk, dram in zip(run["disk"], run["dram"]))

    plain = [statistics.fmean(run["disk"]) for run in pairs["plain"]]
    sealed = [statistics.fmean(run["disk"]) for run in pairs["sealed"]]
    raw = [s / p for p, s in zip(plain, sealed)]
    costs = {kind: [read_cost(run) for run in pairs[kind]] for kind in ("plain", "sealed")}
    read = [(p + s_cost - p_cost) / p for p, p_cost, s_cost in zip(plain, costs["plain"], costs["sealed"])]
    ratio = statistics.median(read)
    n = len(raw)
    print(f"Encryption at rest, disk hits in processes that only re-read the disks, plain and sealed in turn "
          f"({n} pair{'s' if n > 1 else ''}):\n"
          f"- TTFT sealed / plain, each pair: {', '.join(f'{r:.2f}' for r in raw)} "
          f"(median {statistics.median(raw):.2f})\n"
          f"- the disk's read (a disk hit less the same prompt from kvtier's DRAM, same process), each pair: plain "
          f"{', '.join(f'{1000 * c:.1f}' for c in costs['plain'])} ms, sealed "
          f"{', '.join(f'{1000 * c:.1f}' for c in costs['sealed'])} ms; the plain disk hit plus the sealed read's "
          f"extra, over the plain disk hit: {', '.join(f'{r:.2f}' for r in read)}: median {ratio:.2f} "
          f"(target <= 1.10: {'met' if ratio <= 1.10 else 'not met'})")
    return {"plain_means": plain, "sealed_means": sealed, "pair_ratios": raw, "pair_ratio": statistics.median(raw),
            "read_seconds": costs, "read_ratios": read, "ratio": ratio}


# What each kind of hit must cost at most, over vLLM's own hit (issue 29); rows without one show none.
TARGETS = {"DRAM hit": 1.15, "disk hit": 1.30, "after restart": 1.30, "API server, DRAM hit": 1.15,
           "redis hit": 1.6, "redis-cluster hit": 1.6, "s3 hit": 3.0,
           **{f"{tier} hit, {codec}": target for codec in CODEC_PHASES
              for tier, target in (("disk", 1.20), ("redis", 1.3), ("redis-cluster", 1.3), ("s3", 2.0))}}


def hit_rows(results: dict) -> dict[str, dict[str, Any]]:
    """Every phase's pairs as rows (:func:`kvtier.bench.pairs.summary`), with the floor where the bytes moved are
    known (a local tier: DRAM, the disk; a shared tier whose wire speed the run measured) and the target of its
    kind."""
    bw = results.get("kvtier", {}).get("bandwidth")
    out: dict[str, dict[str, Any]] = {}
    for phase in ("kvtier", "restart", "encrypted", *CODEC_PHASES, "api_server"):
        for label, times in results.get(phase, {}).get("pairs", {}).items():
            local = "DRAM hit" in label or "disk hit" in label or "after restart" in label
            shared = not local and bw is not None and "wire" in bw
            if phase in CODEC_PHASES:  # fewer bytes, and their decoding: no floor from the raw bytes' speeds
                local = shared = False
            kind = "shared hit" if shared else "disk hit" if "disk hit" in label or "after restart" in label \
                else "DRAM hit"
            row = pairs.summary(times, kind, bw["bytes"] if bw and (local or shared) else None, bw)
            named = [name for name in TARGETS if name in label]  # the most specific name the label holds
            target = TARGETS[max(named, key=len)] if named else None
            if target is not None and "encrypted" not in label:  # encryption's target is its own (below)
                row["target"] = target
            out[label] = row
    return out


def commit() -> str | None:
    """The checked-out commit of this source tree, for a result file (None outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _print_bandwidth(bw: dict[str, Any], secondary: str) -> None:
    print(f"\nMeasured here for the floor ({bw['bytes'] / 1e6:.0f} MB, a document's KV): copy "
          f"{bw['copy'] / 1e9:.1f} GB/s, page-cache read {bw['read'] / 1e9:.1f} GB/s, checksum "
          f"{bw['checksum'] / 1e9:.1f} GB/s (torch's {inprocess_env()['OMP_NUM_THREADS']} thread(s) for the copy); "
          f"the engine's loads copied layer by layer beside its forward pass: "
          f"{'yes' if bw.get('beside_forward') else 'no'}"
          + (f"; the {secondary} server's wire speed, the tier reading a document's objects "
             f"{bw.get('wire_readers', 1)} at a time: {bw['wire'] / 1e9:.2f} GB/s (a hit from it loads before the "
             f"forward pass, so its floor is vLLM's own hit plus the prefix's bytes at that speed)" if "wire" in bw
             else ""))


def report(results: dict, profile: dict, json_path: Path | None, secondary: str = "disk") -> int:
    rows: dict[str, dict[str, float]] = {}
    for phase in ("baseline", "kvtier", "restart", "encrypted", *CODEC_PHASES, "engine_hit", "api_server"):
        for label, times in results.get(phase, {}).items():
            if isinstance(times, list):
                rows[label] = _summary(times)
    base = rows["vLLM, recompute"]["mean"]
    print(f"\nkvtier bench ({profile['name']}): SmolLM2-135M-Instruct on vLLM "
          f"(CPU), {profile['docs']} documents of {profile['doc_tokens']} tokens, kvtier chunks of "
          f"{profile.get('chunk_tokens', 256)} tokens{'' if profile.get('tails', True) else ' (no tails)'}, "
          f"secondary tier: {secondary}, "
          f"{machine()}\n")
    print("| phase | TTFT mean | p50 | p90 | speedup vs recompute (mean) |")
    print("|---|---|---|---|---|")
    for label, s in rows.items():
        print(f"| {label} | {s['mean']:.3f} s | {s['p50']:.3f} s | {s['p90']:.3f} s | {base / s['mean']:.1f}x |")
    engine, exact = rows["vLLM prefix-cache hit"]["mean"], rows["vLLM prefix-cache hit, exact repeat"]["mean"]
    alone = {label: s["mean"] / (exact if "exact repeat" in label else engine) for label, s in rows.items()
             if label.startswith("kvtier") and "API server" not in label}
    hits = hit_rows(results)
    print("\nEach kvtier hit against vLLM's own hit of the same prompt shape in the same process, moments apart, in "
          "balanced order (TTFT mean / its mean, 1.0 is as fast; 90% bootstrap interval over the pairs; the "
          "floor is vLLM's own hit plus moving the prefix's KV at this machine's measured bandwidth, but for the copy "
          "into vLLM's blocks where the engine copies it layer by layer beside its forward pass):")
    print("Every pair was checked: kvtier's request was served every chunk it needed from the intended tier only, "
          "none missing, and spared computing the whole document; vLLM's own hit found the whole document in its "
          "own prefix cache, nothing from kvtier. "
          "'kvtier first': the pairs whose kvtier request ran first.")
    print("| row | pairs | kvtier first | kvtier | vLLM's own hit | ratio | 90% interval | floor | target |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, h in hits.items():
        floor = f"{h['floor']:.2f}" if "floor" in h else "not known"
        target = (f"<= {h['target']:.2f}: {'met' if h['ratio'] <= h['target'] else 'not met'}"
                  if "target" in h else "")
        print(f"| {label} | {h['pairs']} | {h.get('kvtier_first', '')} | {h['kvtier_mean']:.3f} s "
              f"| {h['engine_mean']:.3f} s | {h['ratio']:.2f} "
              f"| {h['interval'][0]:.2f} to {h['interval'][1]:.2f} | {floor} | {target} |")
    by_order = [f"{label.removeprefix('kvtier, ')} {h['ratio_kvtier_first']:.2f} / {h['ratio_vllm_first']:.2f}"
                for label, h in hits.items() if "ratio_kvtier_first" in h and "ratio_vllm_first" in h]
    if by_order:
        print(f"\nEach order's ratio, kvtier first / vLLM first: {'; '.join(by_order)}")
    if "bandwidth" in results.get("kvtier", {}):
        _print_bandwidth(results["kvtier"]["bandwidth"], secondary)
    print("\nAgainst vLLM alone in a process of its own (the engine_hit phase; processes differ in how fast they "
          "compute, so this moves between runs more than the pairs):")
    for label, value in alone.items():
        print(f"- {label}: {value:.2f}")
    sealed = rows.get("kvtier, disk hit, encrypted")
    encryption: dict[str, Any] | None = None
    if sealed is not None:
        plain = rows["kvtier, disk hit"]["mean"]
        encryption = {"disk_hit_ttft_ratio": sealed["mean"] / plain, "target": 1.10}
        print(f"\nEncryption at rest: disk-hit TTFT with every object sealed / without: "
              f"{sealed['mean'] / plain:.2f} in the two phases above")
    if "reread" in results and encryption is not None:
        encryption["reread"] = _reread(results["reread"])
    noreuse = None
    if "noreuse_plain" in results:
        plain, with_kv = results["noreuse_plain"]["throughput"], results["noreuse_kvtier"]["throughput"]
        noreuse = {"vllm": plain, "kvtier": with_kv}
        print(f"\nNo reuse (every prompt unique): {plain:.0f} tokens/s without kvtier, {with_kv:.0f} with "
              f"({with_kv / plain:.3f} of it)")
        if "noreuse_fp8" in results:
            coded = noreuse["kvtier_fp8"] = results["noreuse_fp8"]["throughput"]
            print(f"No reuse, every write encoded to fp8 on the writer threads: {coded:.0f} tokens/s "
                  f"({coded / plain:.3f} of vLLM alone; one phase each, so within the phases' spread)")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"machine": machine(), "profile": profile, "secondary": secondary,
                                         "vllm_cpu_reserved": server_env()["VLLM_CPU_NUM_OF_RESERVED_CPU"],
                                         "inprocess_omp_threads": inprocess_env()["OMP_NUM_THREADS"],
                                         "date": time.strftime("%Y-%m-%d"), "commit": commit(),
                                         "pairs_design": pairs.DESIGN,
                                         "ttft": rows, "vs_engine_hit": {k: h["ratio"] for k, h in hits.items()},
                                         "hits": hits, "vs_vllm_alone": alone, "noreuse_tokens_per_s": noreuse,
                                         "encryption": encryption,
                                         "raw": results}, indent=2))
    return 0

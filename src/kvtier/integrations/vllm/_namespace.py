"""Namespaces for vLLM requests (scheduler process): everything that changes the KV of the same token ids.

- the model: a fingerprint of its directory's config and weights; a hub id is resolved to its snapshot in the
  local Hugging Face cache (the revision to a commit) and fingerprinted the same way, or refused;
- the engine settings that change KV from the same weights: KV-cache dtype, quantization, the resolved Hugging
  Face config (with ``hf_overrides``, RoPE scaling), the model implementation, sliding window, and
  ``max_model_len`` where the RoPE is scaled (Phi-3's long RoPE picks its factors from it);
- per request: the LoRA adapter (a fingerprint of its files, not its name or path), the cache salt, and the
  multimodal inputs (folded into the keys of the chunks they cover, see :class:`kvtier.keys.Namespace`).

Requests whose token ids cannot name their KV (prompt embeddings) are refused with :class:`Skip`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.keys import InputSpan, Namespace, fingerprint_model, hash_files
from kvtier.recent import RecentMap

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.integrations.vllm")

_ADAPTER_FILES = ("adapter_config.json", ".safetensors", ".bin", ".pt", ".pth")
_LORAS_KEPT = 1024  # adapters whose fingerprints are remembered (a new one is hashed from its files)
# Keys of a Hugging Face config that say where it came from, not what the model computes.
_PROVENANCE = ("_name_or_path", "transformers_version", "_commit_hash")


class Skip(Exception):
    """This request is neither looked up nor saved; ``reason`` labels the counter."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def hub_snapshot(repo: str, revision: str | None, cache_dirs: list[str | None], marker: str) -> Path | None:
    """The snapshot directory of ``repo`` at ``revision`` in a local Hugging Face cache (None: the default
    cache), found through ``marker`` (a file every snapshot has); None when no cache holds it.

    A branch or tag resolves through the cache's ``refs/`` to the commit it pointed to when it was downloaded,
    which is the commit vLLM loaded; nothing is fetched.
    """
    from huggingface_hub import try_to_load_from_cache

    for cache_dir in cache_dirs:
        try:
            path = try_to_load_from_cache(repo, marker, cache_dir=cache_dir, revision=revision)
        except Exception:  # noqa: BLE001 not a valid repo id (e.g. a missing local path): not in any cache
            return None
        if isinstance(path, str):
            return Path(path).parent
    return None


def model_fingerprint(vllm_config: VllmConfig, override: object, where: str = "kv_connector_extra_config") -> str:
    """``override`` when given, else a fingerprint of the model's files (a local directory or a cached hub
    snapshot). Raises :class:`ConfigError` naming ``where``'s ``model_fingerprint`` when neither is possible: a
    guess could serve another model's KV."""
    field = f"{where}.model_fingerprint"
    if override is not None:
        if not isinstance(override, str) or not override:
            raise ConfigError(f"{field}: expected a non-empty string")
        return override
    model = vllm_config.model_config.model
    if Path(model).is_dir():
        return fingerprint_model(model)
    revision = vllm_config.model_config.revision
    download_dir = getattr(vllm_config.load_config, "download_dir", None)
    ask = (f"; set \"model_fingerprint\" in {where} to a string that changes whenever the model's weights or "
           "config do (e.g. the commit hash)")
    snapshot = hub_snapshot(model, revision, [download_dir, None] if download_dir else [None], "config.json")
    if snapshot is None:
        raise ConfigError(f"{field}: model {model!r} (revision {revision or 'main'}) is neither a local directory "
                          f"nor in the local Hugging Face cache, so its weights cannot be fingerprinted{ask}")
    try:
        return fingerprint_model(snapshot)
    except ValueError as exc:
        raise ConfigError(f"{field}: model {model!r}: {exc}{ask}") from exc


def _hf_config(config: object) -> dict[str, Any]:
    to_dict = getattr(config, "to_dict", None)
    data = dict(to_dict() if callable(to_dict) else vars(config))
    for key in _PROVENANCE:
        data.pop(key, None)
    return data


def _rope_scaled(hf: dict[str, Any]) -> bool:
    """Whether any RoPE parameters (per layer type when nested) scale the positions."""
    found: list[dict[str, Any]] = []
    for key in ("rope_parameters", "rope_scaling"):
        params = hf.get(key)
        if isinstance(params, dict):
            nested = [p for p in params.values() if isinstance(p, dict)]
            found.extend(nested or [params])
    return any((p.get("rope_type") or p.get("type") or "default") != "default" for p in found)


def _canonical(value: object) -> object:
    """``value`` with every mapping key a string (configs have int keys, e.g. id2label), so keys can be sorted."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def engine_settings(vllm_config: VllmConfig) -> str:
    """A digest of the engine settings that change the KV computed from the same weights."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    hf = _hf_config(mc.hf_config)  # as vLLM resolved it: hf_overrides and RoPE settings applied
    overrides = mc.hf_overrides
    settings: dict[str, object] = {
        "kv_cache_dtype": str(cc.cache_dtype),
        "calculate_kv_scales": getattr(cc, "calculate_kv_scales", None),
        "quantization": mc.quantization,
        "quantization_config": mc.quantization_config,
        # A callable's effect is in hf_config already; its name is not stable enough to hash.
        "hf_overrides": overrides if isinstance(overrides, dict) else "<callable>",
        "hf_config": hf,
        "model_impl": str(mc.model_impl),
        "disable_sliding_window": mc.disable_sliding_window,
        "code_revision": mc.code_revision if mc.trust_remote_code else None,
    }
    if _rope_scaled(hf):
        settings["max_model_len"] = mc.max_model_len
    blob = json.dumps(_canonical(settings), sort_keys=True, default=str)
    if " at 0x" in blob:  # an object printed by address: this digest is this process's alone
        at = blob.index(" at 0x")
        log.warning("kvtier: the model's settings hold an object without a stable form (%s); KV saved by this "
                    "engine will not be found by another process", blob[max(at - 60, 0):at + 20])
    return "blake2b:" + hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()


def fingerprint_adapter(root: Path) -> str:
    """A fingerprint of a LoRA adapter directory's config and weight files (not of its name or path)."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(_ADAPTER_FILES))
    if not any(p.suffix in _ADAPTER_FILES for p in files):
        raise ValueError(f"no adapter weight files under {root}")
    return "xxh3-lora:" + hash_files(root, files)


class Namespaces:
    """Makes each request's :class:`Namespace` (scheduler side)."""

    def __init__(self, vllm_config: VllmConfig, model_override: object) -> None:
        self.model = model_fingerprint(vllm_config, model_override)
        self.dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        self.settings = engine_settings(vllm_config)
        self._loras: RecentMap[tuple[int, str], str] = RecentMap(_LORAS_KEPT)

    def for_request(self, request: Request) -> Namespace:
        """The request's namespace; raises :class:`Skip` for a request whose KV it cannot name."""
        if request.prompt_embeds is not None:
            raise Skip("prompt_embeds", "its prompt is embeddings, which token ids do not name")
        inputs = []
        for feature in request.mm_features or ():
            if not isinstance(feature.identifier, str) or not feature.identifier:
                raise Skip("multimodal_unhashed", f"its {feature.modality} input has no hash")
            pos = feature.mm_position
            inputs.append(InputSpan(pos.offset, pos.length, f"{feature.modality}:{feature.identifier}"))
        lora = None if request.lora_request is None else self._lora(request.lora_request)
        return Namespace(model=self.model, dtype=self.dtype, lora=lora, cache_salt=request.cache_salt,
                         settings=self.settings, inputs=tuple(inputs))

    def _lora(self, lora: LoRARequest) -> str:
        # vLLM keeps a loaded adapter by its int id (reloading only with load_inplace), so the files read
        # then are the ones hashed here.
        key = (lora.lora_int_id, lora.lora_path)
        if not lora.load_inplace and self._loras.touch(key):
            return self._loras[key]
        local = Path(lora.lora_path)
        root = local if local.is_dir() else hub_snapshot(lora.lora_path, None, [None], "adapter_config.json")
        try:
            if root is None:
                raise ValueError("neither a local directory nor in the local Hugging Face cache")
            fingerprint = fingerprint_adapter(root)
        except (OSError, ValueError) as exc:
            raise Skip("lora_unresolved", f"its LoRA adapter {lora.lora_name!r} at {lora.lora_path!r} cannot be "
                                          f"fingerprinted: {exc}") from exc
        self._loras[key] = fingerprint
        return fingerprint

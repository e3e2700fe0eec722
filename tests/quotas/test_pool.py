"""The DRAM pool's tenant shares (kvtier.quotas.pool): a tenant past its share of DRAM evicts its own least recently
used chunks (an isolated LRU), never another tenant's; reservations count from the moment they are made."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import KVStore, frame
from kvtier.dram import DramPool
from kvtier.eviction import LRUPolicy
from kvtier.keys import HeadRange, ShardKey, chunk_keys
from kvtier.testing import synthetic_kv, synthetic_tokens
from kvtier.testing.quotas import QuotaConformance, QuotaSubject
from tests.quotas.conftest import T, chunk_bytes, config, ns


def test_a_tenant_past_its_dram_share_evicts_its_own_chunks_only() -> None:
    prompts = {name: synthetic_tokens(i, 3 * T) for i, name in enumerate(("a1", "a2", "pub", "b1"))}
    kvs = {name: synthetic_kv(p) for name, p in prompts.items()}
    cfg = config(None, {"dram": 3 * chunk_bytes()})
    cfg["placement"][:1] = [{"salt": salt, "tiers": [], "quota": {"dram": 3 * chunk_bytes()}}
                            for salt in ("team-a", "team-b", "team-*")]  # a rule, and so a share, per tenant
    with KVStore.from_config(cfg) as store:
        store.put(ns("public"), prompts["pub"], kvs["pub"])
        assert store.put(ns("team-a"), prompts["a1"], kvs["a1"]) == 3 * T
        assert store.put(ns("team-a"), prompts["a2"], kvs["a2"]) == 3 * T  # past its share: a1 goes
        assert store.put(ns("team-b"), prompts["b1"], kvs["b1"]) == 3 * T  # a share of its own
        assert store.get(ns("team-a"), prompts["a1"]) is None
        for tenant, name in (("team-a", "a2"), ("public", "pub"), ("team-b", "b1")):
            assert torch.equal(store.get(ns(tenant), prompts[name]), kvs[name]), name
        assert store.stats()["dram"]["evictions_total"] == 3  # a1's three chunks, nothing of anyone else
        big = synthetic_tokens(9, 5 * T)
        assert store.put(ns("team-c"), big, synthetic_kv(big)) == 3 * T  # the leading chunks that fit its share


_TENANTS = ("team-a", "team-b", "public")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_TENANTS), st.integers(0, 5), st.integers(1, 6), st.booleans()),
                min_size=1, max_size=25))
def test_shares_hold_under_any_sequence_of_puts_and_gets(ops: list[tuple[str, int, int, bool]]) -> None:
    """With room in DRAM for everything, a tenant without a quota never loses a chunk, no share ever holds more
    than its quota, and every get is exact or a miss."""
    quota = 4 * chunk_bytes()
    with KVStore.from_config(config(None, {"dram": quota})) as store:
        public: set[int] = set()
        for tenant, seed, chunks, read in ops:
            tokens = synthetic_tokens(seed, chunks * T)
            kv = synthetic_kv(tokens)
            if read:
                got = store.get(ns(tenant), tokens)
                assert got is None or torch.equal(got, kv)
            else:
                stored = store.put(ns(tenant), tokens, kv)
                if stored:  # what a put reports stored is there
                    assert torch.equal(store.get(ns(tenant), tokens[:stored]), kv[:, :, :, :stored])
                if tenant == "public":
                    public.add((seed, chunks))
            for share in {store._tenancy.placement.decide(ns(t)).share for t in _TENANTS} - {None}:
                assert store.dram.share_bytes(share) <= quota
            assert store.dram.audit()["share_mismatch"] == 0
        for seed, chunks in public:
            tokens = synthetic_tokens(seed, chunks * T)
            assert torch.equal(store.get(ns("public"), tokens), synthetic_kv(tokens))


def test_a_prompt_larger_than_the_share_keeps_its_leading_chunks_put_after_put() -> None:
    """Putting it again finds those chunks held: they are never evicted to make room for its later ones."""
    big = synthetic_tokens(20, 5 * T)
    kv = synthetic_kv(big)
    with KVStore.from_config(config(None, {"dram": 3 * chunk_bytes()})) as store:
        for _ in range(3):
            assert store.put(ns("team-a"), big, kv) == 3 * T
            assert torch.equal(store.get(ns("team-a"), big[:3 * T]), kv[:, :, :, :3 * T])


def test_reservations_count_against_the_share_before_they_commit() -> None:
    """Reads ahead and concurrent puts reserve before they commit: the share counts them from the reservation."""
    with KVStore.from_config(config(None, {"dram": 2 * chunk_bytes()})) as store:
        ns_a = ns("team-a")
        store._tenancy.apply_share(ns_a, store._tenancy.placement.decide(ns_a))
        tokens = synthetic_tokens(21, 3 * T)
        meta = frame.ShardMeta(*synthetic_kv(tokens).shape[:1], T, synthetic_kv(tokens).shape[4],
                               torch.bfloat16, frame.HeadRange(0, synthetic_kv(tokens).shape[2],
                                                               synthetic_kv(tokens).shape[2]))

        keys = [ShardKey(ns_a.id, c.hex(), meta.heads) for c in chunk_keys(ns_a, tokens, T)]
        first, second = store.dram.reserve(keys[0], meta, None), store.dram.reserve(keys[1], meta, None)
        assert store.dram.reserve(keys[2], meta, None) == "full"
        store.dram.abort(first)  # an aborted reservation gives its pages back to the share
        third = store.dram.reserve(keys[2], meta, None)
        assert not isinstance(third, str)
        for entry in (second, third):
            store.dram.abort(entry)
        assert store.dram.share_bytes(store._tenancy.placement.decide(ns_a).share) == 0


_POOL_PAGE = 4096
_META = frame.ShardMeta(num_layers=2, chunk_tokens=16, head_dim=16, dtype=torch.bfloat16,
                        heads=HeadRange(0, 4, 4))  # 8 KiB: two pages


class PoolSubject:
    """The conformance suite's subject: a pool with room for far more than any share, driven as the store drives
    it; ``busy``: every entry put or read keeps its reference (pinned: in use)."""

    size = _META.nbytes

    def __init__(self, busy: bool) -> None:
        self.pool = DramPool(64 * _POOL_PAGE, _POOL_PAGE, LRUPolicy())
        self.busy = busy

    def set_share(self, namespace: str, share: str | None, quota_bytes: int = 0) -> None:
        self.pool.set_share(namespace, share, quota_bytes)

    def share_bytes(self, share: str) -> int:
        return self.pool.share_bytes(share)

    def put(self, key: ShardKey) -> bool:
        got = self.pool.reserve(key, _META, None)
        if isinstance(got, str):
            return got == "present"
        self.pool.commit(got, keep_refs=int(self.busy))
        return True

    def read(self, key: ShardKey) -> bool:
        got = self.pool.acquire(key.namespace, key.chunk, [key.heads])
        for entry in got if got is not None and not self.busy else ():
            self.pool.release(entry)
        return got is not None

    def delete(self, key: ShardKey) -> None:
        for entry in self.pool.acquire(key.namespace, key.chunk, [key.heads]) or ():
            self.pool.discard(entry)
            self.pool.release(entry)

    def held(self, namespace: str) -> set[ShardKey]:
        return {k for k in self.pool._by_key if k.namespace == namespace}


class TestPoolSharesConformance(QuotaConformance):
    @pytest.fixture
    def subject(self) -> Callable[[bool], QuotaSubject]:
        return PoolSubject

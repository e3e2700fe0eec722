"""The router's index fed with events as vLLM builds them: hashes from vLLM's own hashing code, extra keys from
vLLM's own conversion; reference counts, places, orphans, clears and reservations."""

from __future__ import annotations

import time

import pytest

from kvtier.router.events import Removed, Stored
from kvtier.router.index import Match, Place, PrefixIndex, request_keys

kvu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
hashing = pytest.importorskip("vllm.utils.hashing")

BS = 4


def vllm_blocks(tokens, *, salt=None, lora=None, hash_name="sha256_cbor"):
    """(event hashes, event extra keys) of a prompt's full blocks, computed by vLLM's own functions."""
    fn = hashing.get_hash_fn_by_name(hash_name)
    kvu.init_none_hash(fn)
    hashes, extras, parent = [], [], None
    for i in range(len(tokens) // BS):
        tagged = []
        if lora:
            tagged.append(("lora", lora, "/adapters/" + lora))
        if i == 0 and salt:
            tagged.append(("cache_salt", salt))
        tagged_keys = tuple(tagged) or None
        parent = kvu.hash_block_tokens(fn, parent, tokens[i * BS:(i + 1) * BS], tagged_keys)
        hashes.append(kvu.maybe_convert_block_hash(parent))
        extras.append(tagged_keys)
    return hashes, kvu.to_event_extra_keys(extras)


def stored(tokens, start=0, end=None, *, salt=None, lora=None, medium="GPU", locality=None):
    hashes, extras = vllm_blocks(tokens, salt=salt, lora=lora)
    end = len(hashes) if end is None else end
    return Stored(hashes=tuple(hashes[start:end]), parent=hashes[start - 1] if start else None,
                  token_ids=tuple(tokens[start * BS:end * BS]), block_size=BS, lora_name=lora, medium=medium,
                  extra_keys=tuple(extras[start:end]) if extras else None, locality=locality)


TOKENS = list(range(100, 124))  # 6 blocks


def test_keys_from_vllm_events_equal_the_routers_keys_for_the_same_prompt():
    index = PrefixIndex(BS)
    index.stored("e0", stored(TOKENS, 0, 2))
    index.stored("e0", stored(TOKENS, 2, 5))  # a later event chains through the first one's hashes
    keys = request_keys(TOKENS + [1, 2], BS)
    assert index.match(keys, ["e0", "e1"]) == {"e0": Match(engine=5, announced=5), "e1": Match()}
    other = request_keys(TOKENS[:8] + [9] * 16, BS)
    assert index.match(other, ["e0"])["e0"] == Match(engine=2, announced=2)


def test_salt_and_lora_only_match_their_own_namespace():
    index = PrefixIndex(BS)
    index.stored("e0", stored(TOKENS, salt="tenant-a"))
    index.stored("e1", stored(TOKENS, lora="sql"))
    for kw, want in [({}, {}), ({"cache_salt": "tenant-a"}, {"e0": 6}), ({"cache_salt": "tenant-b"}, {}),
                     ({"lora_name": "sql"}, {"e1": 6}), ({"lora_name": "sql", "cache_salt": "tenant-a"}, {})]:
        got = index.match(request_keys(TOKENS, BS, **kw), ["e0", "e1"])
        assert {e: m.blocks for e, m in got.items() if m.blocks} == want, kw


def test_reference_counts_a_hash_stored_twice_and_removed_once():
    index = PrefixIndex(BS)
    index.stored("e0", stored(TOKENS, 0, 3))
    index.stored("e0", stored(TOKENS, 0, 3))  # vLLM does not dedupe
    hashes, _ = vllm_blocks(TOKENS)
    index.removed("e0", Removed(hashes=tuple(hashes[:3]), medium="GPU"))
    keys = request_keys(TOKENS, BS)
    assert index.match(keys, ["e0"])["e0"] == Match(engine=3, announced=3)
    index.removed("e0", Removed(hashes=(hashes[1],), medium="GPU"))
    assert index.match(keys, ["e0"])["e0"] == Match(engine=1, announced=1)  # stops at the removed block
    index.removed("e0", Removed(hashes=(hashes[1],), medium="GPU"))
    assert index.counts.unknown_removals == 1


def test_places_and_the_shared_tier_credits_every_engine():
    index = PrefixIndex(BS)
    index.stored("e0", stored(TOKENS, 0, 2))  # engine memory
    index.stored("e0", stored(TOKENS, 0, 3, medium="CPU", locality="LOCAL"))  # kvtier DRAM
    index.stored("e0", stored(TOKENS, 0, 4, medium="STORAGE", locality="LOCAL"))  # kvtier disk
    index.stored("e0", stored(TOKENS, 0, 6, medium="STORAGE", locality="REMOTE"))  # kvtier Redis
    got = index.match(request_keys(TOKENS, BS), ["e0", "e1"])
    # e0: its own memory for 2 blocks; kvtier holds all 6 for it (DRAM first, then disk, then Redis)
    assert got["e0"] == Match(engine=2, host=1, disk=1, shared=2, kvtier=6, announced=2)
    assert got["e1"] == Match(shared=6, kvtier=6)  # loads all of it from the shared tier
    index.clear("e0", [Place.SHARED])
    assert index.match(request_keys(TOKENS, BS), ["e1"])["e1"] == Match()


def test_remove_by_medium_leaves_other_places():
    index = PrefixIndex(BS)
    hashes, _ = vllm_blocks(TOKENS)
    index.stored("e0", stored(TOKENS, 0, 3))
    index.stored("e0", Stored(hashes=tuple(hashes[:3]), parent=None, token_ids=(), block_size=0, medium="CPU"))
    index.removed("e0", Removed(hashes=tuple(hashes[:3]), medium="GPU"))
    assert index.match(request_keys(TOKENS, BS), ["e0"])["e0"] == Match(host=3, kvtier=3)


def test_orphans_are_counted_not_credited_and_other_block_sizes_skipped():
    index = PrefixIndex(BS)
    index.stored("e0", stored(TOKENS, 2, 4))  # parent never announced
    assert index.counts.orphans == 2
    assert index.match(request_keys(TOKENS, BS), ["e0"])["e0"] == Match()
    index.stored("e0", Stored(hashes=(1,), parent=None, token_ids=tuple(range(8)), block_size=8))
    assert index.counts.skipped["block_size"] == 1


def test_parent_announced_by_another_engine_resolves():
    index = PrefixIndex(BS)
    index.stored("e0", stored(TOKENS, 0, 2))
    index.stored("e1", stored(TOKENS, 2, 4, medium="STORAGE", locality="REMOTE"))
    assert index.match(request_keys(TOKENS, BS), ["e1"])["e1"] == Match()  # block 0-1 are only on e0's memory
    index.stored("e1", stored(TOKENS, 0, 2, medium="STORAGE", locality="REMOTE"))
    assert index.match(request_keys(TOKENS, BS), ["e0"])["e0"] == Match(engine=2, shared=2, kvtier=4, announced=2)


def test_clear_forgets_one_engine():
    index = PrefixIndex(BS)
    index.stored("e0", stored(TOKENS))
    index.stored("e1", stored(TOKENS))
    index.clear("e0")
    got = index.match(request_keys(TOKENS, BS), ["e0", "e1"])
    assert got == {"e0": Match(), "e1": Match(engine=6, announced=6)} and index.blocks("e0") == 0


def test_reservations_count_until_they_expire():
    index = PrefixIndex(BS)
    keys = request_keys(TOKENS, BS)
    index.reserve("e1", keys[:4], seconds=0.2, token=1)
    assert index.match(keys, ["e1"])["e1"] == Match(engine=4)
    time.sleep(0.25)
    index.expire()
    assert index.match(keys, ["e1"])["e1"] == Match()


def test_a_reservation_ends_when_the_engine_announces_the_block():
    index = PrefixIndex(BS)
    keys = request_keys(TOKENS, BS)
    index.reserve("e0", keys, seconds=60, token=1)
    index.stored("e0", stored(TOKENS))
    hashes, _ = vllm_blocks(TOKENS)
    index.removed("e0", Removed(hashes=tuple(hashes[3:]), medium="GPU"))  # evicted: no longer credited
    assert index.match(keys, ["e0"])["e0"] == Match(engine=3, announced=3)


def test_a_hash_reused_for_other_tokens_replaces_the_old_block():
    index = PrefixIndex(BS)
    first = Stored(hashes=(7,), parent=None, token_ids=(1, 2, 3, 4), block_size=BS)
    index.stored("e0", first)
    index.stored("e0", Stored(hashes=(7,), parent=None, token_ids=(5, 6, 7, 8), block_size=BS))
    index.removed("e0", Removed(hashes=(7,), medium="GPU"))  # no KeyError, and nothing left credited
    assert index.blocks("e0") == 0
    assert index.match(request_keys([1, 2, 3, 4], BS), ["e0"])["e0"] == Match()


def test_one_failed_request_leaves_anothers_reservation():
    index = PrefixIndex(BS)
    keys = request_keys(TOKENS, BS)
    index.reserve("e0", keys, seconds=60, token=1)
    index.reserve("e0", keys, seconds=60, token=2)
    index.unreserve("e0", keys, token=1)
    assert index.match(keys, ["e0"])["e0"].engine == 6
    index.unreserve("e0", keys, token=1)  # taken back twice: still only its own
    assert index.match(keys, ["e0"])["e0"].engine == 6
    index.unreserve("e0", keys, token=2)
    assert index.match(keys, ["e0"])["e0"].engine == 0


def lines_run(fn) -> int:
    """How many lines of index.py ``fn`` runs: the index's work, counted rather than timed."""
    import sys

    import kvtier.router.index as module

    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename == module.__file__:
            if event == "line":
                count += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def filled(n: int) -> PrefixIndex:
    """An index crediting e0 with ``n`` blocks (hashes 0 to n-1, each a chain of its own)."""
    index = PrefixIndex(BS)
    index.stored("e0", Stored(hashes=tuple(range(n)), parent=None, token_ids=tuple(range(n * BS)), block_size=BS))
    return index


def test_an_event_costs_its_own_size_whatever_the_engine_holds():
    """The attack: a batch reusing 40 held hashes for other tokens (and removing 40) scanned every held block per
    hash; now the lines the index runs for it do not grow with what the engine holds."""
    reuse = Stored(hashes=tuple(range(40)), parent=None, token_ids=tuple(range(7, 7 + 40 * BS)), block_size=BS)
    removal = Removed(hashes=tuple(range(100, 140)), medium="GPU")
    costs = []
    for n in (200, 4000):
        index = filled(n)
        costs.append(lines_run(lambda index=index: (index.stored("e0", reuse), index.removed("e0", removal))))
        assert index.counts.skipped["hash_reused"] == 40 and index.blocks("e0") == n - 40
    assert costs[0] == costs[1], costs


def test_places_are_counted_without_walking_the_entries():
    small, large = filled(10), filled(2000)
    assert lines_run(lambda: small.places("e0")) == lines_run(lambda: large.places("e0"))
    assert large.places("e0") == {"engine": 2000, "host": 0, "disk": 0, "shared": 0}


def test_the_per_engine_cap_drops_the_least_recently_stored_blocks():
    index = PrefixIndex(BS, max_engine_blocks=4)
    for h in range(4):
        index.stored("e0", Stored(hashes=(h,), parent=None, token_ids=(h,) * BS, block_size=BS))
    index.stored("e0", Stored(hashes=(0,), parent=None, token_ids=(0,) * BS, block_size=BS))  # 0 used again
    index.stored("e0", Stored(hashes=(9, 10), parent=None, token_ids=(9,) * BS + (10,) * BS, block_size=BS))
    assert index.blocks("e0") == 4 and index.counts.skipped["engine_cap"] == 2
    held = [h for h in range(4) if index.match(request_keys([h] * BS, BS), ["e0"])["e0"].engine]
    assert held == [0, 3]  # 1 and 2 were the least recently stored
    index.stored("e1", Stored(hashes=(1,), parent=None, token_ids=(1,) * BS, block_size=BS))
    assert index.blocks("e1") == 1  # the cap is each engine's own
    index.removed("e0", Removed(hashes=(1,), medium="GPU"))  # an evicted block's removal: unknown, no error
    assert index.counts.unknown_removals == 1


def test_clearing_in_slices_lets_other_work_run_between_them():
    index = filled(10_000)
    index.stored("e0", Stored(hashes=(5,), parent=None, token_ids=(), block_size=0, medium="STORAGE",
                              locality="REMOTE"))  # block 5 also on a shared tier
    seen = [index.blocks("e0") for _ in index.clearing("e0", [Place.ENGINE], slice_blocks=1000)]
    assert seen[:3] == [9001, 8001, 7001] and len(seen) == 10  # 1000 a slice
    assert index.blocks("e0") == 1 and index.places("e0")["shared"] == 1


def test_an_engine_that_left_the_fleet_is_forgotten_with_what_it_announced_in_a_shared_tier():
    """Its events will never remove what it announced anywhere: the index drops it all (in slices), and the
    engine joining again under the same name starts from nothing (no double count of the shared blocks)."""
    index = PrefixIndex(BS)
    index.stored("e0", stored(TOKENS, 0, 6, medium="STORAGE", locality="REMOTE"))
    assert index.match(request_keys(TOKENS, BS), ["e1"])["e1"] == Match(shared=6, kvtier=6)
    slices = list(index.leaving("e0", slice_blocks=2))
    assert len(slices) >= 2  # yielded between slices
    assert index.match(request_keys(TOKENS, BS), ["e1"])["e1"] == Match()
    assert index.blocks("e0") == 0 and index.places("e0")["shared"] == 0
    index.stored("e0", stored(TOKENS, 0, 6, medium="STORAGE", locality="REMOTE"))  # back, replayed
    index.removed("e0", Removed(hashes=tuple(vllm_blocks(TOKENS)[0]), medium="STORAGE", locality="REMOTE"))
    assert index.match(request_keys(TOKENS, BS), ["e1"])["e1"] == Match()  # one removal un-credits them


def test_announced_counts_the_engines_own_blocks_from_the_first_reservations_aside():
    """e0 announced six blocks, then evicted the third; a request routed there reserved it again. Its hit is six
    blocks, of which the first two are announced: the router tells blocks the engine holds from blocks a request
    is still computing there."""
    index = PrefixIndex(BS)
    keys = request_keys(TOKENS, BS)
    index.stored("e0", stored(TOKENS))
    hashes, _ = vllm_blocks(TOKENS)
    index.removed("e0", Removed(hashes=(hashes[2],), medium="GPU"))
    index.reserve("e0", keys[2:3], seconds=60, token=1)
    assert index.match(keys, ["e0"])["e0"] == Match(engine=6, announced=2)

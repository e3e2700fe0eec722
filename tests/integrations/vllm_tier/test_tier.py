"""kvtier's tier under vLLM's own tiering manager (``TieringOffloadingSpec(...).get_manager()``, stepped as vLLM's
scheduler steps it, on CPU): stores cascade into kvtier's tiers, loads are exact, what an earlier process stored
is found, a Redis outage fails jobs and never raises, a full disk evicts by its watermarks, moved, forged and
sealed-then-moved objects are misses, events announce stores and removals, and rows are never confused with
another layout's, another model's or kvtier's own connector's KV."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadKey, ReqContext, ScheduleEndContext

from kvtier import KVStore, Namespace
from kvtier.errors import ConfigError
from kvtier.integrations.vllm_tier import KVTierSecondaryTier
from kvtier.sealing import write_key_file
from kvtier.testing.servers import RedisServer
from kvtier.testing.vllm_tiering import Tiering, chunk_names, row_bytes
from tests.integrations.vllm_tier.conftest import ROW, MakeTiering, disk, kvtier_config, tier_entry

STORE_SCRIPT = """
import json, sys
from kvtier.testing.vllm_tiering import Tiering, chunk_names, offloading_config
entry, prompt, count = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
t = Tiering(offloading_config([entry], model="smollm", cpu_bytes=1 << 20, layers=4, kv_bytes_per_token_layer=256,
                              tokens_per_block=16))
assert len(t.store(chunk_names(prompt, count))) == count
t.settle()
t.close()  # the tier's shutdown lets kvtier's cascade finish its writes
print("stored", count)
"""


def kvtier_tier(t: Tiering) -> KVTierSecondaryTier:
    tier = t.tiers[0]
    assert isinstance(tier, KVTierSecondaryTier)
    return tier


def written(t: Tiering) -> None:
    """Every job ended and every cascade write landed."""
    t.settle()
    kvtier_tier(t).store.flush()


def from_tiers_only(t: Tiering) -> None:
    """Empty vLLM's primary tier and kvtier's DRAM: what is served next comes from kvtier's tiers."""
    t.evict_primary()
    kvtier_tier(t).store.drop_dram()


def exact(t: Tiering, keys: list, rows: list[np.ndarray]) -> bool:
    return len(rows) == len(keys) and all(np.array_equal(r, row_bytes(k, t.row_bytes)) for r, k in zip(rows, keys))


def stored_in_subprocess(entry: dict, prompt: str, count: int) -> None:
    proc = subprocess.run([sys.executable, "-c", STORE_SCRIPT, json.dumps(entry), prompt, str(count)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"stored {count}" in proc.stdout, proc.stderr[-3000:]


def test_stores_cascade_to_kvtiers_tiers_and_load_back_exactly(make_tiering: MakeTiering, tmp_path: Path) -> None:
    t = make_tiering(tier_entry(kvtier_config(disk(tmp_path / "kv"))))
    assert t.row_bytes == ROW
    keys = chunk_names("a system prompt", 12)
    assert t.store(keys) == keys
    written(t)
    tier = kvtier_tier(t)
    listed = {o.key for o in tier.store.tiers[0].list(tier.namespace.id)}
    assert listed == set(tier.object_keys(keys))  # one object a row, under the tier's namespace
    from_tiers_only(t)
    assert exact(t, keys, t.load(keys))
    assert tier.store.stats()["disk"]["hit_chunks_total"] >= 12
    # vLLM's primary holds them again: a second store of the same rows writes nothing to kvtier.
    assert t.store(keys) == []


def test_a_later_process_finds_and_loads_what_an_earlier_one_stored(make_tiering: MakeTiering,
                                                                     tmp_path: Path) -> None:
    entry = tier_entry(kvtier_config(disk(tmp_path / "kv")))
    stored_in_subprocess(entry, "restart", 8)
    t = make_tiering(entry)
    keys = chunk_names("restart", 8)
    assert t.lookup(keys) == 8
    assert exact(t, keys, t.load(keys))
    assert t.lookup(chunk_names("never stored", 2)) == 0


def test_two_processes_share_rows_through_redis(make_tiering: MakeTiering, redis_server: RedisServer,
                                                unique_prefix: str) -> None:
    redis = {"type": "redis", "name": "redis", **redis_server.tier_options(), "key_prefix": unique_prefix}
    entry = tier_entry(kvtier_config(redis))
    stored_in_subprocess(entry, "shared", 6)
    t = make_tiering(entry)
    keys = chunk_names("shared", 6)
    assert t.lookup(keys) == 6  # asked on vLLM's lookup thread: "retry" first, then found
    assert exact(t, keys, t.load(keys))
    assert t.lookup(keys + chunk_names("elsewhere", 1)) == 6


def promotion_pending(t: Tiering, key: OffloadKey) -> ReqContext:
    """A request whose lookup found ``key`` in kvtier's tiers: its promotion is allocated in the primary tier and
    submitted to kvtier's tier at the next step."""
    ctx = t.request()
    deadline = time.monotonic() + 30
    while (result := t.manager.lookup(key, ctx)) is not LookupResult.HIT_PENDING:
        assert result is LookupResult.RETRY and time.monotonic() < deadline, result
        t.step()
        time.sleep(0.002)
    return ctx


def test_a_redis_outage_fails_jobs_and_lookups_without_raising(make_tiering: MakeTiering, tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        redis = {"type": "redis", "name": "redis", **server.tier_options(), "socket_timeout": 0.5,
                 "connect_timeout": 0.5, "retry_seconds": 0.2}
        t = make_tiering(tier_entry(kvtier_config(redis)))
        tier = kvtier_tier(t)
        keys = chunk_names("outage", 4)
        t.store(keys)
        written(t)
        from_tiers_only(t)
        ctx = promotion_pending(t, keys[0])  # found in Redis: vLLM submits its promotion next step
        server.stop()
        t.step()  # the load job is submitted, and fails
        t.settle()
        assert t.manager.lookup(keys[0], ctx) is LookupResult.MISS  # failed, and answered missing after it
        t.finish(ctx)
        assert t.lookup(keys) == 0  # missing, not an exception
        assert tier.store.stats()["redis"]["tier_outage{what=reads}"] == 1
        # Stores go on into kvtier's DRAM; the tier's writes are dropped and counted, none raises.
        more = chunk_names("during the outage", 3)
        assert t.store(more) == more
        written(t)
        stats = tier.store.stats()["redis"]
        assert stats["dropped_writes_total{reason=tier_unavailable}"] + stats["write_errors_total"] >= 1
        server.start()  # back (empty: no persistence): once its rest ends, new rows reach it again
        deadline = time.monotonic() + 30
        for attempt in itertools.count():
            after = chunk_names(f"after the outage {attempt}", 2)
            t.store(after)
            written(t)
            from_tiers_only(t)
            if exact(t, after, t.load(after)):
                break
            assert time.monotonic() < deadline, "the tier never came back"
            time.sleep(0.2)
    finally:
        server.stop()


def test_a_full_disk_evicts_by_its_watermarks(make_tiering: MakeTiering, tmp_path: Path) -> None:
    capacity = 12 * (ROW + 4096)
    t = make_tiering(tier_entry(kvtier_config(disk(tmp_path / "kv", capacity_bytes=capacity, high_watermark=0.9,
                                                   low_watermark=0.5))))
    tier = kvtier_tier(t)
    keys = chunk_names("a long document", 40)
    for i in range(0, 40, 4):
        t.store(keys[i:i + 4])
        written(t)
    fs = tier.store.tiers[0]
    assert fs.used_bytes() <= capacity * 0.9
    assert fs.counters()["evictions"] > 0
    from_tiers_only(t)
    assert t.lookup(keys[-4:]) == 4  # the latest kept, the earliest gone
    assert t.lookup(keys[:1]) == 0
    assert exact(t, keys[-4:], t.load(keys[-4:]))


def _file(root: Path, chunk: str) -> Path:
    (found,) = [p for p in root.rglob(f"{chunk}*") if p.is_file()]
    return found


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_moved_and_forged_objects_are_misses_never_wrong_rows(make_tiering: MakeTiering, tmp_path: Path,
                                                              sealed: bool) -> None:
    extra = {}
    if sealed:
        write_key_file(str(tmp_path / "master"))
        extra = {"encryption": {"key": f"file:{tmp_path / 'master'}", "keyring": str(tmp_path / "keyring")}}
    t = make_tiering(tier_entry(kvtier_config(disk(tmp_path / "kv"), **extra)))
    tier = kvtier_tier(t)
    keys = chunk_names("tampered", 3)
    t.store(keys)
    written(t)
    a, b, c = (_file(tmp_path / "kv", key.chunk) for key in tier.object_keys(keys))
    shutil.copyfile(a, b)  # a's object under b's name
    blob = bytearray(c.read_bytes())
    blob[-100] ^= 0xFF  # one bit flipped in c's payload
    c.write_bytes(bytes(blob))
    from_tiers_only(t)
    assert exact(t, keys[:1], t.load(keys[:1]))
    assert t.load(keys[1:2]) == []  # a's bytes are never served as b's
    assert t.load(keys[2:3]) == []
    assert tier.store.stats()["disk"]["corrupt_objects_total"] >= 2
    own = row_bytes(keys[0], ROW)[:64].tobytes()
    assert (own in a.read_bytes()) is not sealed  # sealed: the row's bytes are nowhere in its object


def test_events_announce_stores_and_removals(make_tiering: MakeTiering, tmp_path: Path) -> None:
    t = make_tiering(tier_entry(kvtier_config(disk(tmp_path / "kv")), enable_kv_events=True), events=True)
    tier = kvtier_tier(t)
    keys = chunk_names("announced", 3)
    t.store(keys)
    written(t)
    t.step()
    ours = [e for e in t.events() if e.ownership == "kvtier:disk"]
    assert sorted((e.keys, e.removed, e.medium, e.locality, e.removal_expected) for e in ours) == \
        sorted(([key], False, Medium.STORAGE, Locality.LOCAL, True) for key in keys)
    _file(tmp_path / "kv", tier.object_keys(keys[:1])[0].chunk).unlink()  # gone behind kvtier's back
    from_tiers_only(t)
    assert t.load(keys[:1]) == []
    gone = [e for e in t.events() if e.ownership == "kvtier:disk"]
    assert [(e.keys, e.removed) for e in gone] == [([keys[0]], True)]


def test_rows_are_kept_apart_from_other_layouts_models_and_kvtiers_connector(make_tiering: MakeTiering,
                                                                             tmp_path: Path) -> None:
    cfg = kvtier_config(disk(tmp_path / "kv"))
    keys = chunk_names("one prompt", 4)
    first = make_tiering(tier_entry(cfg))
    first.store(keys)
    written(first)
    ns = kvtier_tier(first).namespace
    # Another KV layout (HND), another block size, another model: the same names find nothing.
    for other in (make_tiering(tier_entry(cfg), layout="LBHNC"), make_tiering(tier_entry(cfg), tokens_per_block=32),
                  make_tiering(tier_entry(cfg, model_fingerprint="another-model"))):
        assert kvtier_tier(other).namespace.id != ns.id
        assert other.lookup(keys) == 0
    # kvtier's own connector, same model and dtype, same directory: its own namespace and keys.
    connector_ns = Namespace(model="test-model", dtype="bfloat16", settings="blake2b:" + "0" * 32)
    with KVStore.from_config({**cfg, "chunk_tokens": 16}) as store:
        tokens = list(range(64))
        assert store.put(connector_ns, tokens, torch.ones(4, 2, 1, 64, 128, dtype=torch.bfloat16)) == 64
        store.flush()
        ids = {o.key.namespace for o in store.tiers[0].list()}
    assert ids == {ns.id, store.named(connector_ns).id}
    from_tiers_only(first)
    assert exact(first, keys, first.load(keys))


def test_bad_entries_are_refused_naming_the_field(make_tiering: MakeTiering, tmp_path: Path) -> None:
    cfg = kvtier_config(disk(tmp_path / "kv"))
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['capacity'\]; allowed: \[.*'config'"):
        make_tiering(tier_entry(cfg, capacity=5))
    with pytest.raises(ConfigError, match=r"workers: an integer in \[1, 64\]"):
        make_tiering(tier_entry(cfg, workers=0))
    with pytest.raises(ConfigError, match="locality: LOCAL or REMOTE"):
        make_tiering(tier_entry(cfg, locality="NEAR"))
    with pytest.raises(ConfigError, match="set model_fingerprint"):
        make_tiering(tier_entry(cfg, model_fingerprint=None), model="HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.type"):
        make_tiering(tier_entry(kvtier_config({"type": "floppy", "path": "x"})))


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
def test_rows_stay_exact_under_a_tiers_codec(make_tiering: MakeTiering, tmp_path: Path, codec: str) -> None:
    """A row is bytes to kvtier: ``lossless`` compresses it, a lossy codec leaves it as it is; both load exact."""
    t = make_tiering(tier_entry(kvtier_config(disk(tmp_path / "kv", codec=codec))))
    keys = chunk_names("coded", 3)
    zeros = [np.zeros(ROW, dtype=np.uint8) for _ in keys]  # compressible
    t.store(keys, zeros)
    written(t)
    stored = sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*.kv"))
    from_tiers_only(t)
    rows = t.load(keys)
    assert len(rows) == 3 and all(np.array_equal(r, z) for r, z in zip(rows, zeros))
    assert (stored < ROW) if codec == "lossless" else (stored > 3 * ROW)


def test_a_stalled_redis_never_blocks_the_schedulers_calls(make_tiering: MakeTiering, tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        redis = {"type": "redis", "name": "redis", **server.tier_options(), "socket_timeout": 30.0}
        t = make_tiering(tier_entry(kvtier_config(redis)))
        keys = chunk_names("stalled", 2)
        t.store(keys)
        written(t)
        from_tiers_only(t)
        ctx = promotion_pending(t, keys[0])
        os.kill(server.pid, signal.SIGSTOP)  # answers nothing, closes nothing
        try:
            t.step()  # submits the promotion: queued on kvtier's threads, not waited for
            assert t.manager.has_pending_work()
            assert t.manager.lookup(keys[0], ctx) is LookupResult.HIT_PENDING
            for _ in range(3):  # the next key: asked again and again while the lookup thread waits on the server
                assert t.manager.lookup(keys[1], ctx) is LookupResult.RETRY
                t.step()
        finally:
            os.kill(server.pid, signal.SIGCONT)
        t.finish(ctx)
        t.settle()
        assert exact(t, keys, t.load(keys))  # served once the server answers again
    finally:
        server.stop()


@pytest.mark.parametrize("where", ["redis", "disk written by another engine"])
def test_each_key_is_answered_on_its_own_across_groups_and_from_the_end(make_tiering: MakeTiering,
                                                                         redis_server: RedisServer,
                                                                         unique_prefix: str, tmp_path: Path,
                                                                         where: str) -> None:
    """vLLM asks one request's keys of several KV cache groups in one step, a sliding window's from its end: no
    key's answer depends on another's. On a disk, the rows are another engine's, written after this one started
    (not in its index: found on disk)."""
    if where == "redis":
        cfg = kvtier_config({"type": "redis", "name": "redis", **redis_server.tier_options(),
                             "key_prefix": unique_prefix})
    else:
        cfg = kvtier_config(disk(tmp_path / "kv"))
    t = make_tiering(tier_entry(cfg))
    writer = t if where == "redis" else make_tiering(tier_entry(cfg))
    tier = kvtier_tier(t)
    full, window = chunk_names("hybrid", 8, group=0), chunk_names("hybrid", 8, group=1)
    stored = full[:5] + window[3:]  # the window's group keeps its last chunks only
    writer.store(stored)
    written(writer)
    from_tiers_only(t)
    ctx = t.request()
    asked = full + window[::-1]
    answers: dict[OffloadKey, LookupResult] = {}
    deadline = time.monotonic() + 30
    while len(answers) < len(asked):
        for key in asked:
            if key not in answers and (result := tier.lookup(key, ctx)) is not LookupResult.RETRY:
                answers[key] = result
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        assert time.monotonic() < deadline
        time.sleep(0.002)
    tier.on_request_finished(ctx)
    assert {k for k, r in answers.items() if r is LookupResult.HIT} == set(stored)


def test_rows_in_kvtiers_dram_are_found_at_once(make_tiering: MakeTiering, tmp_path: Path) -> None:
    t = make_tiering(tier_entry(kvtier_config(disk(tmp_path / "kv"))))
    keys = chunk_names("hot", 2)
    t.store(keys)
    written(t)
    t.evict_primary()  # kvtier's DRAM still holds them: no "retry", no lookup thread
    ctx = t.request()
    assert [kvtier_tier(t).lookup(k, ctx) for k in keys] == [LookupResult.HIT] * 2
    t.finish(ctx)


def test_a_bad_row_fails_alone_and_the_rest_of_its_job_is_served(make_tiering: MakeTiering, tmp_path: Path) -> None:
    t = make_tiering(tier_entry(kvtier_config(disk(tmp_path / "kv"))))
    tier = kvtier_tier(t)
    keys = chunk_names("one bad row", 6)
    t.store(keys)
    written(t)
    bad = _file(tmp_path / "kv", tier.object_keys(keys[2:3])[0].chunk)
    blob = bytearray(bad.read_bytes())
    blob[-10] ^= 1  # a lookup finds the file; its load finds it corrupt
    bad.write_bytes(bytes(blob))
    from_tiers_only(t)
    ctx = t.request()
    deadline = time.monotonic() + 30
    while LookupResult.RETRY in [t.manager.lookup(k, ctx) for k in keys]:  # all asked, all found in one step
        t.step()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    t.settle()  # one promotion job of the six rows
    results = [t.manager.lookup(k, ctx) for k in keys]
    t.finish(ctx)
    assert [r is LookupResult.HIT for r in results] == [True, True, False, True, True, True]
    rows = t.load(keys[3:])
    assert exact(t, keys[3:], rows)  # served from the primary tier: the job kept them
    t.store(keys[2:3])  # whole again in the tier (kvtier removed the corrupt object on its read) ...
    written(t)
    from_tiers_only(t)
    assert kvtier_tier(t).found(keys[2:3]) == [True]
    assert t.lookup(keys[2:3]) == 0  # ... yet answered missing for FAILED_SECONDS: not promoted again and again


def test_a_row_no_longer_remembered_as_announced_is_announced_removed(make_tiering: MakeTiering,
                                                                     tmp_path: Path) -> None:
    """vLLM's event tracker keeps an announced row's metadata until its removal: the tier remembers a bounded
    number of announced rows, and announces removed the ones it forgets."""
    t = make_tiering(tier_entry(kvtier_config(disk(tmp_path / "kv")), enable_kv_events=True), events=True)
    kvtier_tier(t)._held.limit = 2  # (ANNOUNCED_KEPT, made small)
    keys = chunk_names("many", 3)
    for key in keys:  # one at a time: announced in this order
        t.store([key])
        written(t)
        t.step()
    events = [(e.keys, e.removed) for e in t.events() if e.ownership == "kvtier:disk"]
    assert events == [([keys[0]], False), ([keys[1]], False), ([keys[2]], False), ([keys[0]], True)]

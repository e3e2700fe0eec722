"""``KVTierSecondaryTier``: vLLM's ``SecondaryTierManager`` over a :class:`~kvtier.store.KVStore` (scheduler
process; every hook vLLM calls while serving returns without waiting on a tier or a disk: the constructor,
``drain_jobs`` and ``shutdown`` wait, as vLLM's contract has them).

- **Stores** (``submit_store``): a job on kvtier's threads copies the rows out of vLLM's primary tier into kvtier's
  DRAM (:meth:`KVStore.put_from`, skipping rows DRAM holds already); kvtier's cascade writes them to its tiers from
  there, behind the job. The job succeeds once DRAM holds every row (vLLM may then reuse the primary's slots);
  a tier that drops a write counts it in kvtier's metrics (``kvtier_dropped_writes_total``).
- **Lookups**: kvtier's DRAM answers at once; its tiers, a local disk's included, are asked on vLLM's lookup thread
  (``AsyncLookupManager``: the answer is "retry" until then), each key on its own (vLLM asks one request's keys of
  several KV cache groups, and a sliding window's from its end, in one step). A load job first asks which of its
  rows are held (one pass), then reads those.
- **Loads** (``submit_load``): a job reads the rows (verified: a torn, forged or moved object is a miss) into the
  primary's slots, each on its own: a row not served fails alone (the job reports the rows it did serve), and its
  key is answered missing for :data:`FAILED_SECONDS`, so vLLM does not promote it again and again.
- **Faults**: a tier in an outage answers missing and fails loads; no hook raises for a tier's fault.
- **Events** (``enable_kv_events``, when vLLM publishes KV events): each row a kvtier tier came to hold, with that
  tier's locality and ``ownership`` ``kvtier:<tier name>``; a row announced and then found missing in a tier that
  answered (evicted, expired, removed as corrupt) is announced removed, as is one the tier stops remembering
  (past :data:`ANNOUNCED_KEPT`: vLLM's event tracker keeps each announced row's metadata until its removal).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.config import StoreConfig, load_config
from kvtier.errors import ConfigError
from kvtier.integrations.vllm_tier import _naming
from kvtier.integrations.vllm_tier._jobs import LOAD, STORE, Jobs
from kvtier.keys import HeadRange, NamedChunks, Namespace, ShardKey
from kvtier.recent import RecentMap
from kvtier.store import KVStore

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("kvtier.integrations.vllm_tier")

FAILED_SECONDS = 30.0  # a key whose load failed is answered missing this long
DRAM_ROWS = 4  # rows kvtier's DRAM must hold at least: one being written behind while the next ones are put
_KEYS_KEPT = 1 << 18  # rows remembered by name (for events) and by failure
ANNOUNCED_KEPT = 1 << 16  # rows announced stored and remembered as such (each costs vLLM's tracker its metadata)
_FIELD = "secondary_tiers[KVTierSecondaryTier]"
_ONE_HEAD = HeadRange(0, 1, 1)  # a row is stored as one shard of one "head"


@dataclasses.dataclass(frozen=True)
class Options:
    """The tier's entry in ``secondary_tiers`` (beside vLLM's ``type``, ``module_path`` and ``backpressure``)."""

    config: Mapping[str, object] | str | None = None  # kvtier's config, inline or a YAML path ($KVTIER_CONFIG)
    model_fingerprint: str | None = None
    enable_kv_events: bool = False
    workers: int = 2  # threads running the tier's load and store jobs
    locality: str | None = None  # LOCAL or REMOTE; default: LOCAL when every kvtier tier is local

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> Options:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"{_FIELD}: unknown option(s) {unknown}; allowed: {sorted(known)}")
        got = cls(**options)
        if got.config is not None and not isinstance(got.config, (str, os.PathLike, Mapping)):
            raise ConfigError(f"{_FIELD}.config: a mapping or a YAML file path, got {type(got.config).__name__}")
        if not isinstance(got.enable_kv_events, bool):
            raise ConfigError(f"{_FIELD}.enable_kv_events: true or false, got {got.enable_kv_events!r}")
        if isinstance(got.workers, bool) or not isinstance(got.workers, int) or not 1 <= got.workers <= 64:
            raise ConfigError(f"{_FIELD}.workers: an integer in [1, 64], got {got.workers!r}")
        if got.locality not in (None, "LOCAL", "REMOTE"):
            raise ConfigError(f"{_FIELD}.locality: LOCAL or REMOTE, got {got.locality!r}")
        return got


def store_config(options: Options, row_bytes: int, tokens: int) -> StoreConfig:
    """kvtier's config for the tier: its chunk is vLLM's; it needs a tier, and DRAM for a few rows."""
    config = load_config(options.config)
    if config.admission.store_after > 1:  # vLLM cascades a row once, while its primary holds it: never a 2nd put
        log.warning("kvtier tier: admission.store_after %d does not apply to vLLM's rows (vLLM offers a row once); "
                    "every row is stored", config.admission.store_after)
    config = dataclasses.replace(config, chunk_tokens=tokens,
                                 admission=dataclasses.replace(config.admission, store_after=1))
    if not config.tiers:
        raise ConfigError(f"{_FIELD}.config.tiers: at least one kvtier tier (filesystem, redis, s3, mooncake); "
                          "kvtier's DRAM alone would only repeat vLLM's primary tier")
    if config.dram.capacity_bytes < DRAM_ROWS * row_bytes:
        raise ConfigError(f"{_FIELD}.config.dram.capacity_bytes: {config.dram.capacity_bytes} bytes hold fewer than "
                          f"{DRAM_ROWS} rows of {row_bytes} bytes (every row is written to kvtier's tiers from its "
                          f"DRAM); give it at least {DRAM_ROWS * row_bytes}")
    return config


class _Lookups(AsyncLookupManager):
    """Lookups in kvtier's tiers, on vLLM's lookup thread."""

    def __init__(self, tier: KVTierSecondaryTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.found(keys)


class KVTierSecondaryTier(SecondaryTierManager):
    """kvtier's tiers as one secondary tier of vLLM's ``TieringOffloadingManager``."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, **options: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        opts = Options.parse(options)
        config = offloading_spec.config
        self._shape = _naming.RowShape.of(self.block_size_bytes, _naming.chunk_tokens(config), _FIELD)
        ns = _naming.namespace(config, self.block_size_bytes, opts.model_fingerprint, _FIELD,
                               _naming.engine_config(config.model.name))
        self._store = KVStore(store_config(opts, self.block_size_bytes, self._shape.tokens))
        # (after the store: a refused config leaves no view of the primary's memory, which vLLM then unmaps)
        rows = np.asarray(primary_kv_view).view(np.uint8)
        self._rows = torch.from_numpy(rows).view(rows.shape[0], -1)  # (chunks, row bytes): no copy
        self._ns = self._store.named(ns)  # (named once: its key is the deployment's)
        self._lookups: _Lookups | None = None
        try:
            local = all(tier.local for tier in self._store.tiers)
            self.locality = Locality(opts.locality or ("LOCAL" if local else "REMOTE"))
            self._lookups = _Lookups(self, tier_type)
            self._jobs: Jobs[TransferJob, JobResult] = Jobs(self._run, self._failed, opts.workers,
                                                            f"kvtier-vllm-{tier_type}")
        except BaseException:
            if self._lookups is not None:
                self._lookups.shutdown()
            self._store.close()
            raise
        self._failed_at: RecentMap[OffloadKey, float] = RecentMap(_KEYS_KEPT)  # scheduler thread only
        self._loading: dict[int, list[OffloadKey]] = {}  # load jobs' keys, until their results are taken
        events = opts.enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        if opts.enable_kv_events and not events:
            log.warning("kvtier tier: enable_kv_events is set but vLLM publishes no KV events; none are made")
        self._watcher = self._store.watch_tier_writes() if events else None
        self._events: list[OffloadingEvent] | None = [] if events else None
        self._names: RecentMap[str, OffloadKey] = RecentMap(_KEYS_KEPT)  # chunk key (hex) -> its row's name
        # announced: where each row lies; one forgotten is announced removed (vLLM's tracker would keep it forever)
        self._held: RecentMap[OffloadKey, set[str]] = RecentMap(ANNOUNCED_KEPT, on_drop=self._forgotten)
        self._local = {tier.name: tier.local for tier in self._store.tiers}
        log.info("kvtier tier %s: tiers %s, rows of %d bytes (%d tokens), namespace %s", tier_type,
                 [t.name for t in self._store.tiers], self.block_size_bytes, self._shape.tokens, self._ns.id)

    @property
    def store(self) -> KVStore:
        """The kvtier store behind this tier (its metrics, its tiers)."""
        return self._store

    @property
    def namespace(self) -> Namespace:
        """The namespace of this engine's rows, as the store names it (its ``id`` is what ``kvtier cache ls``
        shows)."""
        return self._ns

    def object_keys(self, keys: Collection[OffloadKey]) -> list[ShardKey]:
        """The stored objects' keys of ``keys`` (e.g. to find one in a tier)."""
        return [ShardKey(self._ns.id, chunk.hex(), _ONE_HEAD) for chunk in self._named(keys).keys(self._ns)]

    # -- lookups -----------------------------------------------------------------------------------------------
    def _named(self, keys: Collection[OffloadKey]) -> NamedChunks:
        return NamedChunks([bytes(key) for key in keys], self._shape.tokens)

    def found(self, keys: list[OffloadKey]) -> list[bool]:
        """Whether kvtier holds each of ``keys`` (DRAM or any tier; may wait on a disk or a network)."""
        return self._store.lookup_each(self._ns, self._named(keys), kv_heads=1) if keys else []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        failed = self._failed_at.get(key)
        if failed is not None and time.monotonic() - failed < FAILED_SECONDS:
            return LookupResult.MISS
        t = self._shape.tokens
        if self._store.held(self._ns, self._named([key]), kv_heads=1):  # kvtier's DRAM: no I/O
            self._store.count_lookup(t, t)
            return LookupResult.HIT
        assert self._lookups is not None
        answer = self._lookups.lookup(key, req_context)
        if answer is None:
            return LookupResult.RETRY
        if answer:
            return LookupResult.HIT
        self._gone([key])
        return LookupResult.MISS

    # -- jobs --------------------------------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        if self._events is not None:
            for key, shard in zip(job_metadata.keys, self.object_keys(job_metadata.keys)):
                self._names[shard.chunk] = key
        self._jobs.submit(job_metadata, STORE)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._loading[job_metadata.job_id] = list(job_metadata.keys)
        self._jobs.submit(job_metadata, LOAD)

    def _run(self, job: TransferJob) -> JobResult:
        """Do one job (on a job thread)."""
        start = time.perf_counter()
        keys, ids = list(job.keys), [int(i) for i in job.chunk_ids]
        assert len(keys) == len(ids), f"job {job.job_id}: {len(keys)} keys for {len(ids)} slots"
        if job.is_promotion:
            served = self._load(keys, ids)
            done, moved = len(served) == len(keys), len(served)
        else:
            held, moved = self._put(keys, ids)
            done = held == len(keys)
        return JobResult(job_id=job.job_id, success=done,
                         successful_keys=tuple(served) if job.is_promotion and served and not done else None,
                         transfer_time=time.perf_counter() - start, transfer_bytes=moved * self.block_size_bytes)

    def _load(self, keys: list[OffloadKey], ids: list[int]) -> list[OffloadKey]:
        """Read ``keys``' rows into the slots ``ids``: the keys served. Which rows are held is asked once; each run
        of held rows is read in one load (a row that fails its read fails alone: the run goes on after it)."""
        held = self._store.lookup_each(self._ns, self._named(keys), kv_heads=1, count=False)
        served: list[OffloadKey] = []
        start = 0
        while start < len(keys):
            if not held[start]:
                start += 1
                continue
            stop = next((i for i in range(start, len(keys)) if not held[i]), len(keys))
            served += self._load_run(keys, ids, start, stop)
            start = stop
        return served

    def _load_run(self, keys: list[OffloadKey], ids: list[int], start: int, stop: int) -> list[OffloadKey]:
        """:meth:`_load` of ``keys[start:stop]``, all held when asked."""
        s, served = self._shape, []
        while start < stop:
            def sink(first: int, kv: torch.Tensor, at: int = start) -> None:
                for i in range(kv.shape[0]):
                    self._rows[ids[at + first + i]].view(kv.shape[1:]).copy_(kv[i])

            n = self._store.load(self._ns, self._named(keys[start:stop]), sink, layers=s.layers, head_dim=s.width,
                                 dtype=torch.uint8, kv_heads=1, streamed=self._store.remote_tiers) // s.tokens
            served += keys[start:start + n]
            start += n + 1  # past the row that was not served
        return served

    def _put(self, keys: list[OffloadKey], ids: list[int]) -> tuple[int, int]:
        """Copy ``keys``' rows from the slots ``ids`` into kvtier's DRAM: the rows it holds from the first (a put
        stops at the first row DRAM has no room for), and the rows copied (not held before)."""
        s, copied = self._shape, 0

        def source(first: int, dst: torch.Tensor) -> None:
            nonlocal copied
            for i in range(dst.shape[0]):
                dst[i].copy_(self._rows[ids[first + i]].view(dst.shape[1:]))
            copied += dst.shape[0]

        held = self._store.put_from(self._ns, self._named(keys), source, layers=s.layers, head_dim=s.width,
                                    dtype=torch.uint8, kv_heads=1) // s.tokens
        return held, copied

    @staticmethod
    def _failed(job: TransferJob, exc: BaseException) -> JobResult:
        return JobResult(job_id=job.job_id, success=False)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = self._jobs.take()
        # The jobs are the manager's; the keys a failed load did not serve are the tier's to remember.
        now = time.monotonic()
        for result in results:
            loading = self._loading.pop(result.job_id, None)
            if loading is None or result.success:
                continue
            served = set(result.successful_keys or ())
            missing = [key for key in loading if key not in served]
            for key in missing:
                self._failed_at[key] = now
            self._gone(missing)
        return results

    # -- events ------------------------------------------------------------------------------------------------
    def _gone(self, keys: Iterable[OffloadKey]) -> None:
        """Rows found missing: those announced stored are announced removed from every tier they were in that
        answered (a tier in an outage says nothing of what it holds: its rows stay announced)."""
        events = self._events
        announced = [key for key in keys if key in self._held] if events is not None else []
        if events is None or not announced:
            return
        failing = self._store.reads_failing()
        for key in announced:
            tiers = self._held.pop(key) or set()
            kept = {tier for tier in tiers if tier in failing}
            if kept:
                self._held[key] = kept
            for tier in sorted(tiers - kept):
                events.append(self._event([key], tier, removed=True))

    def _forgotten(self, key: OffloadKey, tiers: set[str]) -> None:
        """A row no longer remembered as announced: announced removed (it may still lie in a tier; a router that
        stops crediting it loses at most a hit)."""
        if self._events is not None:
            self._events.extend(self._event([key], tier, removed=True) for tier in sorted(tiers))

    def _event(self, keys: list[OffloadKey], tier: str, removed: bool) -> OffloadingEvent:
        # removal_expected: this tier announces its removals too (vLLM's event tracker keeps the rows' metadata
        # for them, past the primary tier's own removal).
        return OffloadingEvent(keys=keys, medium=self.medium, removed=removed,
                               locality=Locality.LOCAL if self._local.get(tier) else Locality.REMOTE,
                               ownership=f"kvtier:{tier}", removal_expected=True)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return []
        if self._watcher is not None:
            for shard, tier in self._store.take_tier_writes(self._watcher):
                key = self._names.get(shard.chunk)
                held = self._held.get(key) if key is not None else None
                if key is None or (held is not None and tier in held):
                    continue  # another process's row promoted here, or announced already
                self._events.append(self._event([key], tier, removed=False))
                self._held[key] = (held or set()) | {tier}  # (may forget the oldest: announced removed after)
        events, self._events = self._events, []
        return events

    # -- the rest of vLLM's interface --------------------------------------------------------------------------
    def has_pending_work(self) -> bool:
        return self._jobs.pending

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        assert self._lookups is not None
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        assert self._lookups is not None
        self._lookups.flush()

    def drain_jobs(self) -> None:
        """Wait for every job submitted (the cascade's writes read kvtier's DRAM, not the primary: not waited
        for)."""
        self._jobs.drain()

    def shutdown(self) -> None:
        """End the jobs, the lookups and the store (its queued writes finish first)."""
        try:
            self._jobs.close()
            if self._lookups is not None:
                self._lookups.shutdown()
        finally:
            self._store.close()
            self._rows = torch.empty(0, 0, dtype=torch.uint8)  # vLLM unmaps the primary next: no view may remain

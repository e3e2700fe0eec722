"""The LMCache worker of the peer benchmark: one group of timed operations through ``LMCacheEngine``, in its own
process.

    python _lmcache_side.py --group {dram,disk,disk-restart,redis} --shape NAME --out FILE [--dir D]
                            [--url redis://... | resp://...]

Like kvtier's worker, it warms up with one batch, then times a few rounds, each on a batch of its own. What is
driven: ``LMCacheEngine.store`` / ``retrieve`` (token hashing, allocation from LocalCPUBackend's memory
allocator, the StorageManager and its backends), built by ``LMCacheEngineBuilder`` as LMCache's standalone mode
does. LMCache's own GPU connectors need CUDA (or XPU, HPU, MUSA), so :class:`CopyConnector` stands in: one torch
copy per chunk between a memory object and a CPU tensor in LMCache's ``KV_2LTD`` layout, the work kvtier's
``put``/``get`` do between its DRAM pages and the caller's tensor.

- ``dram``: LocalCPUBackend holds the chunks (``local_cpu=True``).
- ``disk``: LocalDiskBackend (``local_cpu=False``: no hot copy in DRAM, so each retrieve reads the files; the
  LocalCPUBackend stays the allocator). A store ends when LMCache has written and indexed every chunk.
- ``disk-restart``: a new engine on the directory a ``disk`` run left. LocalDiskBackend keeps its index in memory
  only, so it is expected to find nothing; the worker reports what it finds.
- ``redis``: RemoteBackend with ``remote_url`` ``redis://`` (RedisConnector, redis-py's asyncio client) or
  ``resp://`` (RESPConnector, LMCache's C++ ``LMCacheRedisClient``). A store ends when the batched put completes.
"""

from __future__ import annotations

import asyncio
import os

# Before lmcache is imported: it reads these at import time.
os.environ["LMCACHE_TRACK_USAGE"] = "false"  # no usage reports
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import sys
import threading
import traceback
from pathlib import Path

import torch

from _common import (CHUNK, SHAPES, WARMUP_BATCH, Result, Shape, batch_tokens, lmcache_layout, make_kv, parse_args,
                     timed_batches)
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.v1.storage_backend.connector.instrumented_connector import InstrumentedRemoteConnector
from lmcache.v1.storage_backend.connector.redis_connector import RESPConnector
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

GROUPS = ("dram", "disk", "disk-restart", "redis")
INSTANCE = "peers-bench"
DRAM_GIB = 1.0  # kvtier's side gets the same 1 GiB pool
DISK_GIB = 8.0
WRITE_TIMEOUT_S = 60.0  # under _common.WORKER_DEADLINE_S, so a lost write fails with its own message
CLOSE_TIMEOUT_S = 2.0


class CopyConnector(GPUConnectorInterface):
    """LMCache's connector interface over a CPU tensor ``kvcaches`` ``[2, layers, tokens, heads * head_dim]``."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, start:end])

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        kwargs["kvcaches"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.shape.layers, num_tokens, self.shape.kv_heads * self.shape.head_dim])


class WriteWaiter:
    """Waits for the writes a backend reports done, from LMCache's own completion hooks (wrapped on the instance).

    LocalDiskBackend takes a key out of its in-flight list once the file is written and indexed
    (``LocalDiskWorker.remove_put_task``): one event per chunk. RemoteBackend calls ``batched_put_callback`` when a
    batched put's future ends: one event per store.
    """

    def __init__(self, backend: StorageBackendInterface) -> None:
        self._done = threading.Semaphore(0)
        self.errors: list[str] = []
        if isinstance(backend, LocalDiskBackend):
            worker = backend.disk_worker
            removed = worker.remove_put_task

            def on_removed(key) -> None:
                removed(key)
                self._done.release()

            worker.remove_put_task = on_removed
            self.per_chunk = True
        else:
            assert backend.connection is not None and backend.connection.support_batched_put(), \
                "the remote connector must put in batches (one completion per store)"
            callback = backend.batched_put_callback

            def on_put(future, keys) -> None:
                callback(future, keys)
                if future.exception() is not None:  # LMCache's callback drops it; a failed put must fail the run
                    self.errors.append(repr(future.exception()))
                self._done.release()

            backend.batched_put_callback = on_put
            self.per_chunk = False

    def wait(self, chunks: int) -> None:
        for _ in range(chunks if self.per_chunk else 1):
            if not self._done.acquire(timeout=WRITE_TIMEOUT_S):
                raise TimeoutError(f"LMCache did not report its writes done within {WRITE_TIMEOUT_S} s")
        if self.errors:
            raise RuntimeError(f"LMCache's put failed: {self.errors}")


def register_before_completion(backend: StorageBackendInterface) -> bool:
    """Work around a lost-completion race in LMCache 0.5.6's native RESP client; True if it was applied.

    ``ConnectorClientBase.batch_exists_sync`` (which ``retrieve`` calls through ``batched_contains``) submits to the
    C++ client and only then registers its future; a reply drained by the event loop in between is dropped and the
    caller waits forever (raised in review of LMCache PR #2541). Here it runs the async variant on the event loop
    instead, where submit and register happen with no completion drained between them. Without it about 3 in 8
    ``resp://`` workers hung in their first retrieve on this machine.
    """
    connection = getattr(backend, "connection", None)
    inner = connection.getWrappedConnector() if isinstance(connection, InstrumentedRemoteConnector) else connection
    if not isinstance(inner, RESPConnector):
        return False
    client = inner.client

    def batch_exists_sync(keys: list[str]) -> list[bool]:
        return asyncio.run_coroutine_threadsafe(client.batch_exists(keys), client.loop).result()

    client.batch_exists_sync = batch_exists_sync
    return True


def build_engine(group: str, shape: Shape, args) -> LMCacheEngine:
    options: dict[str, object] = {"chunk_size": CHUNK, "local_cpu": group == "dram", "max_local_cpu_size": DRAM_GIB,
                                  "lmcache_instance_id": INSTANCE}
    if group.startswith("disk"):
        options.update(local_disk=f"{args.dir}/", max_local_disk_size=DISK_GIB)
    elif group == "redis":
        options.update(remote_url=args.url, remote_serde="naive")
    config = LMCacheEngineConfig.from_defaults(**options)
    metadata = LMCacheMetadata(model_name="peers-bench", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.bfloat16,
                               kv_shape=(shape.layers, 2, CHUNK, shape.kv_heads, shape.head_dim))
    # The broadcast functions serve save_only_first_rank (MLA across ranks) only: unused here.
    engine = LMCacheEngineBuilder.get_or_create(INSTANCE, config, metadata, CopyConnector(shape), None, None)
    engine.post_init()
    return engine


def run(group: str, shape: Shape, args, result: Result) -> None:
    kv = lmcache_layout(make_kv(shape))
    out = torch.zeros_like(kv)
    engine = build_engine(group, shape, args)
    assert engine.storage_manager is not None
    backends = engine.storage_manager.storage_backends
    result.notes.append(f"backends: {list(backends)}")

    def retrieve(batch: int) -> int:
        return int(engine.retrieve(batch_tokens(batch, shape), kvcaches=out).sum())

    if group == "disk-restart":
        for batch in timed_batches():
            result.found("lookup", engine.lookup(batch_tokens(batch, shape)))
            out.zero_()
            found = result.time("retrieve", lambda: retrieve(batch))  # noqa: B023 timed at once
            result.check("retrieve", out, kv, found, shape.tokens)
        files = len(list(Path(args.dir).glob("*.pt")))
        result.notes.append(f"{files} chunk files from the earlier process lie in the directory; this process's "
                            f"LocalDiskBackend found {result.found_tokens['retrieve']} tokens of each batch")
        return
    tier = [b for name, b in backends.items() if name != "LocalCPUBackend"]
    waiter = WriteWaiter(tier[0]) if tier else None
    if tier and register_before_completion(tier[0]):
        result.notes.append("applied the workaround for the RESP client's lost-completion race "
                            "(register_before_completion)")

    def store(batch: int) -> None:
        engine.store(batch_tokens(batch, shape), kvcaches=kv)
        if waiter is not None:
            waiter.wait(shape.chunks)

    store(WARMUP_BATCH)
    result.check("warmup", out, kv, retrieve(WARMUP_BATCH), shape.tokens)
    for batch in timed_batches():
        if group == "dram":
            engine.clear()  # free the chunks held, so the batch lands on pages already faulted in
        result.time("store", lambda: store(batch))  # noqa: B023 timed at once
        out.zero_()
        found = result.time("retrieve", lambda: retrieve(batch))  # noqa: B023 timed at once
        result.check("retrieve", out, kv, found, shape.tokens)


def close(result: Result) -> None:
    """Destroy the engine, giving up after a while: in 0.5.6 the Redis and RESP connectors' ``close`` awaits
    ``pq_executor.shutdown``, a blocking call that waits on the event loop it is running on, so it never returns."""
    closer = threading.Thread(target=LMCacheEngineBuilder.destroy, args=(INSTANCE,), daemon=True)
    closer.start()
    closer.join(CLOSE_TIMEOUT_S)
    if closer.is_alive():
        result.notes.append(f"LMCacheEngineBuilder.destroy did not return within {CLOSE_TIMEOUT_S:.0f} s; "
                            "the worker exited without it")


def main() -> int:
    args = parse_args("LMCache", GROUPS)
    shape = SHAPES[args.shape]
    result = Result("LMCache", args.group, shape.name)
    run(args.group, shape, args, result)
    close(result)
    result.write(args.out)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:  # noqa: BLE001 reported, then hard exit: a failed run must not hang on LMCache's threads
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # LMCache's event-loop threads may outlive a close that gave up; do not wait for them

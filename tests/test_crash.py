"""SIGKILL a process in the middle of a write storm, many times: what a restarted store returns is complete and
correct, and the dead writers' temp files are cleaned up."""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from kvtier import KVStore
from kvtier.frame import decode, payload_tensor
from kvtier.keys import chunk_keys
from kvtier.testing import synthetic_kv, synthetic_tokens
from tests.conftest import NS, store_config

T = 16
PROMPTS = 400
CHUNKS = 4

WRITER = textwrap.dedent("""
    import sys
    from kvtier import KVStore
    from kvtier.testing import synthetic_kv, synthetic_tokens
    from tests.conftest import NS, store_config
    cfg = store_config(sys.argv[1], dram="64MiB", workers=4)
    store = KVStore.from_config(cfg)
    print("ready", flush=True)
    start = int(sys.argv[2])
    for i in range(start, start + %(prompts)d):
        tokens = synthetic_tokens(i, %(chunks)d * %(t)d)
        store.put(NS, tokens, synthetic_kv(tokens, heads=32, head_dim=64))
    store.flush()
    print("finished", flush=True)
""") % {"prompts": PROMPTS, "chunks": CHUNKS, "t": T}
KILLS = 6


def test_sigkill_during_write_storm_never_leaves_bad_chunks(tmp_path: Path) -> None:
    fs = tmp_path / "fs"
    rng = random.Random(1234)
    repo = Path(__file__).resolve().parent.parent
    torn = 0
    for run in range(KILLS):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(fs), str(run * PROMPTS)], cwd=repo,
                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(repo)})
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.1, 0.8))
        # Kill while a write is in flight: the writer spends most of its time making KV, so a kill at a random
        # moment often falls between writes. Watch for a temp file and kill the moment one is there.
        deadline = time.monotonic() + 10
        while not any((fs / ".tmp").glob("*.part")) and time.monotonic() < deadline:
            time.sleep(0.0005)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        torn += len(list((fs / ".tmp").iterdir()))
    assert torn > 0, "no kill landed in the middle of a file write"

    with KVStore.from_config(store_config(fs)) as store:
        tier = store.tiers[0]
        assert not list((fs / ".tmp").iterdir())  # dead writers' temp files are gone
        objects = list(tier.list())
        assert objects, "the writer never got a chunk to disk"
        chunks = {key.hex(): (i, c) for i in range(KILLS * PROMPTS)
                  for c, key in enumerate(chunk_keys(store.named(NS), synthetic_tokens(i, CHUNKS * T), T))}
        prompt_kv = functools.lru_cache(maxsize=2)(lambda i: synthetic_kv(synthetic_tokens(i, CHUNKS * T), heads=32,
                                                                           head_dim=64))
        for obj in sorted(objects, key=lambda o: chunks[o.key.chunk]):  # a prompt's files one after another
            # every file that survived is whole, verified, and holds its chunk's KV
            blob = tier.get(obj.key)
            assert blob is not None
            header, payload = decode(blob, expected=obj.key)
            i, c = chunks[obj.key.chunk]
            expected = prompt_kv(i)[:, :, :, c * T:(c + 1) * T]
            assert torch.equal(payload_tensor(payload, header.meta), expected), f"file of prompt {i} chunk {c}"
        hits = 0
        for i in range(KILLS * PROMPTS):
            tokens = synthetic_tokens(i, CHUNKS * T)
            n = store.lookup(NS, tokens)
            if n:
                got = store.get(NS, tokens[:n])
                assert got is not None
                expected = synthetic_kv(tokens, heads=32, head_dim=64)[:, :, :, :n]
                assert torch.equal(got, expected), _wrong(store, tokens[:n], got, expected)
                hits += 1
        assert hits > 0
        assert store.stats()["filesystem"].get("corrupt_objects_total", 0) == 0


def _wrong(store: KVStore, tokens: list[int], got: torch.Tensor, expected: torch.Tensor) -> str:
    """What a get that returned other KV than was put got wrong: per chunk, the elements that differ (in which
    layers and heads), and whether a second get of the same tokens, read from the files again (DRAM emptied), is
    right: the files were checked above, so a wrong first get and a right second one is a read gone wrong."""
    if got.shape != expected.shape:
        return f"got shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    lines = []
    try:
        for c in range(got.shape[3] // T):
            wrong = (got[:, :, :, c * T:(c + 1) * T] != expected[:, :, :, c * T:(c + 1) * T]).nonzero()
            if len(wrong):
                lines.append(f"chunk {c}: {len(wrong)} elements differ, layers {sorted(set(wrong[:, 0].tolist()))}, "
                             f"heads {sorted(set(wrong[:, 2].tolist()))[:8]}")
        store.drop_dram()
        again = store.get(NS, tokens)
        lines.append(f"a second get is {'right' if again is not None and torch.equal(again, expected) else 'wrong'}")
    except Exception as exc:  # noqa: BLE001 the explanation must never hide the failure it explains
        lines.append(f"(explaining it raised {exc!r})")
    return "; ".join(lines)

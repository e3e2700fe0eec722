"""SIGKILL a process in the middle of a write storm, many times: what a restarted store returns is complete and
correct, and the dead writers' temp files are cleaned up."""

from __future__ import annotations

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
from kvtier.frame import decode
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
        for obj in objects:  # every file that survived is whole and verified
            blob = tier.get(obj.key)
            assert blob is not None
            decode(blob, expected=obj.key)
        hits = 0
        for i in range(KILLS * PROMPTS):
            tokens = synthetic_tokens(i, CHUNKS * T)
            n = store.lookup(NS, tokens)
            if n:
                got = store.get(NS, tokens[:n])
                assert got is not None
                assert torch.equal(got, synthetic_kv(tokens, heads=32, head_dim=64)[:, :, :, :n])
                hits += 1
        assert hits > 0
        assert store.stats()["filesystem"].get("corrupt_objects_total", 0) == 0

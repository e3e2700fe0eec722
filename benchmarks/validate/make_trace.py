"""Write the validation trace `kvtier validate` is judged on here (benchmarks/validate/trace.jsonl).

Mooncake's format with 256-token blocks, sized for vLLM on 2 CPU cores with SmolLM2-135M: 8 documents of 1-5K
tokens asked about with Zipf-like popularity (each request: a document and a question of 40-250 tokens of its
own), one request in five a prompt of its own; Poisson arrivals 3 s apart on average; 8 output tokens.

    .venv/bin/python benchmarks/validate/make_trace.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

BLOCK = 256


def main() -> None:
    rng = np.random.default_rng(20261201)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    docs = [fresh(n) for n in (4, 6, 8, 10, 12, 5, 16, 20)]
    weights = 1 / np.arange(1, len(docs) + 1)
    order = rng.permutation(len(docs))  # popularity not by length
    t = 0.0
    lines = []
    for _ in range(64):
        t += rng.exponential(3.0)
        if rng.random() < 0.2:
            blocks = fresh(int(rng.integers(2, 12)))
            length = len(blocks) * BLOCK - int(rng.integers(1, BLOCK))
        else:
            doc = docs[order[rng.choice(len(docs), p=weights / weights.sum())]]
            question = int(rng.integers(40, 250))
            blocks = doc + fresh(1)
            length = len(doc) * BLOCK + question
        lines.append({"timestamp": round(t * 1000), "input_length": length, "output_length": 8,
                      "hash_ids": blocks})
    path = Path(__file__).parent / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {path}: {len(lines)} requests over {t:.0f} s")


if __name__ == "__main__":
    main()

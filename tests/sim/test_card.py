"""Workload cards: the numbers a card gives are the trace's, and its blocks share what kvtier's keys would."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import Namespace, chunk_keys
from kvtier.sim.card import CardError, _blocks, generate, load_card


def card(**fields):
    return load_card(fields)


def test_the_same_card_gives_the_same_trace_and_another_seed_another() -> None:
    spec = {"requests": 50, "shared_prefix": {"tokens": 300, "fan_out": 3},
            "prompt_tokens": {"median": 200, "p90": 500}}
    one, two = generate(card(**spec), 128), generate(card(**spec), 128)
    assert one == two
    assert generate(card(**spec, seed=1), 128).trace != one.trace


def test_arrivals_lengths_and_outputs_follow_the_card() -> None:
    w = generate(card(requests=4000, arrival={"rate_per_s": 2.0}, prompt_tokens={"median": 800, "p90": 2400},
                      output_tokens=7), 256)
    times = np.array([r.timestamp_ms for r in w.trace.requests]) / 1000
    assert len(times) == 4000 and np.all(np.diff(times) >= 0)
    assert (len(times) - 1) / times[-1] == pytest.approx(2.0, rel=0.05)
    lengths = np.array([r.input_length for r in w.trace.requests])
    assert np.median(lengths) == pytest.approx(800, rel=0.05)
    assert np.percentile(lengths, 90) == pytest.approx(2400, rel=0.08)
    assert {r.output_length for r in w.trace.requests} == {7}


def test_sessions_of_several_turns_keep_the_rate_from_the_first_request() -> None:
    # Sessions begin before time 0, so the trace opens in steady state: requests arrive at the card's rate
    # throughout, also with long sessions.
    w = generate(card(requests=20000, arrival={"rate_per_s": 5.0}, sessions={"turns": 10, "think_time_s": 30},
                      prompt_tokens={"median": 50, "p90": 50}, output_tokens=10), 256)
    times = np.array([r.timestamp_ms for r in w.trace.requests]) / 1000
    assert times[0] >= 0 and len(times) == 20000
    assert (len(times) - 1) / (times[-1] - times[0]) == pytest.approx(5.0, rel=0.06)
    first_tenth = np.sum(times < times[-1] / 10)
    assert first_tenth == pytest.approx(2000, rel=0.12)  # no ramp-up: the first 400 s as busy as the rest


def test_burstiness_zero_spaces_sessions_evenly_and_above_one_bunches_them() -> None:
    even = generate(card(requests=100, arrival={"rate_per_s": 4.0, "burstiness": 0}), 256).trace
    gaps = np.diff([r.timestamp_ms for r in even.requests])
    assert gaps == pytest.approx(np.full(99, 250.0))
    bursty = generate(card(requests=4000, arrival={"rate_per_s": 4.0, "burstiness": 3.0}), 256).trace
    gaps = np.diff([r.timestamp_ms for r in bursty.requests])
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.15)


def test_a_shared_prefix_is_shared_within_a_tenant_and_adapter_only() -> None:
    w = generate(card(requests=400, shared_prefix={"tokens": 1000}, tenants=3, lora_adapters=2,
                      prompt_tokens={"median": 50, "p90": 50}), 256)
    heads: dict[tuple[int, ...], int] = {}
    for r in w.trace.requests:
        heads[r.blocks[:3]] = heads.get(r.blocks[:3], 0) + 1  # 1000 tokens: 3 whole blocks
    assert len(heads) == 6  # one system prompt per (tenant, adapter)
    assert len({r.blocks[3] for r in w.trace.requests}) == 400  # the block holding the message is each request's


def test_a_turn_extends_its_session_s_previous_prompt() -> None:
    w = generate(card(requests=60, sessions={"turns": 3, "think_time_s": 5.0},
                      prompt_tokens={"median": 300, "p90": 600}, output_tokens=40), 64)
    by_session: dict[int, list] = {}
    for r, s in zip(w.trace.requests, w.sessions):
        by_session.setdefault(s, []).append(r)
    assert max(len(turns) for turns in by_session.values()) == 3
    for turns in by_session.values():
        for before, after in itertools.pairwise(turns):
            assert after.timestamp_ms - before.timestamp_ms == pytest.approx(5000)
            assert after.blocks[:before.whole] == before.blocks[:before.whole]
            assert after.input_length > before.input_length + 40


def test_documents_follow_their_popularity() -> None:
    w = generate(card(requests=3000, documents={"count": 10, "tokens": 512, "skew": 1.0},
                      prompt_tokens={"median": 10, "p90": 10}), 256)
    counts: dict[int, int] = {}
    for r in w.trace.requests:
        counts[r.blocks[1]] = counts.get(r.blocks[1], 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    assert len(ranked) == 10
    assert ranked[0] / 3000 == pytest.approx(1 / sum(1 / k for k in range(1, 11)), rel=0.1)


CONTENT = {"sys": 1, "doc": 2, "q1": 3, "q2": 4}
SEGMENTS = st.lists(st.tuples(st.sampled_from(["sys", "doc", "q1", "q2"]), st.integers(1, 40)), min_size=1,
                    max_size=4, unique_by=lambda s: s[0])


@settings(max_examples=200, deadline=None)
@given(SEGMENTS, SEGMENTS, st.tuples(st.integers(0, 1), st.integers(-1, 1)),
       st.tuples(st.integers(0, 1), st.integers(-1, 1)), st.integers(1, 16))
def test_blocks_are_shared_exactly_when_kvtier_keys_are(a, b, ns_a, ns_b, block) -> None:
    # Give each segment name fixed content and length per example; the same name is the same text.
    size = dict(a + b)
    a = [(name, size[name]) for name, _ in a]
    b = [(name, size[name]) for name, _ in b]
    ids: dict[object, int] = {}
    ours_a, _ = _blocks(a, ns_a, block, ids)
    ours_b, _ = _blocks(b, ns_b, block, ids)

    def keys(segments, ns):
        tokens = [CONTENT[name] * 100 + i for name, n in segments for i in range(n)]
        namespace = Namespace("m", "bfloat16", lora=None if ns[1] < 0 else f"adapter{ns[1]}",
                              cache_salt=f"tenant{ns[0]}")
        return list(chunk_keys(namespace, tokens, block))

    theirs_a, theirs_b = keys(a, ns_a), keys(b, ns_b)
    assert len(ours_a) == len(theirs_a) and len(ours_b) == len(theirs_b)
    assert [x == y for x, y in zip(ours_a, ours_b)] == [x == y for x, y in zip(theirs_a, theirs_b)]


@pytest.mark.parametrize("fields, message", [
    ({"rquests": 10}, "card.rquests: unknown key"),
    ({"arrival": {"rate_per_s": 0}}, "arrival.rate_per_s: expected a number >= 1e-06 and <= 1e+06"),
    ({"arrival": {"burstiness": -1}}, "arrival.burstiness: expected a number >= 0"),
    ({"arrival": {"burstiness": 1e-160}}, "arrival.burstiness: 0 (even gaps) or from 0.01 to 100"),
    ({"arrival": {"burstiness": 1e200}}, "arrival.burstiness: expected a number >= 0 and <= 100"),
    ({"sessions": {"turns": 3}}, "sessions.think_time_s: must be > 0 when sessions.turns > 1"),
    ({"prompt_tokens": {"median": 500, "p90": 100}}, "prompt_tokens.p90: 100 is below the median 500"),
    ({"prompt_tokens": {"median": "long"}}, "prompt_tokens.median: expected an integer from 1 to"),
    ({"shared_prefix": {"tokens": 2**30}}, "shared_prefix.tokens: expected an integer from 0 to 1048576"),
    ({"documents": {"count": 3, "skew": "high"}}, "documents.skew: expected a number"),
    ({"sessions": [1, 2]}, "sessions: expected a mapping"),
    ({"tenants": True}, "card.tenants: expected an integer from 1 to 1000000"),
    ({"lossy_kv": "maybe"}, "card.lossy_kv: expected true or false, got 'maybe'"),
    ({"lossy_kv": 1}, "card.lossy_kv: expected true or false, got 1"),
])
def test_bad_cards_name_the_field(fields, message) -> None:
    with pytest.raises(CardError, match=re.escape(message)):
        load_card(fields)


def test_lossy_kv_is_off_unless_the_card_allows_it(tmp_path: Path) -> None:
    assert card().lossy_kv is False and card(lossy_kv=True).lossy_kv is True
    (tmp_path / "card.yaml").write_text("requests: 10\nlossy_kv: true\n")
    assert load_card(tmp_path / "card.yaml").lossy_kv is True
    # the trace is the workload's alone: allowing lossy KV changes what decide weighs, not the requests
    assert generate(card(requests=20, lossy_kv=True), 256).trace == generate(card(requests=20), 256).trace


def test_bad_card_files_say_why(tmp_path: Path) -> None:
    with pytest.raises(CardError, match="cannot read"):
        load_card(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_bytes(b"requests: \xff\n")
    with pytest.raises(CardError, match="not UTF-8"):
        load_card(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("requests: [1,\n")
    with pytest.raises(CardError, match="not YAML"):
        load_card(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("- 1\n")
    with pytest.raises(CardError, match="card: expected a mapping"):
        load_card(tmp_path / "bad.yaml")
    (tmp_path / "empty.yaml").write_text("# every default\n")
    assert load_card(tmp_path / "empty.yaml").requests == 200


def test_cards_that_would_need_too_much_are_refused() -> None:
    long = card(requests=50, sessions={"turns": 1000, "think_time_s": 1}, prompt_tokens={"median": 2000},
                output_tokens=2000)
    with pytest.raises(CardError, match="sessions.turns: a prompt reaches"):
        generate(long, 256)
    crowded = card(requests=10, arrival={"rate_per_s": 1e5}, sessions={"turns": 2, "think_time_s": 1e6})
    with pytest.raises(CardError, match="sessions.think_time_s: sessions lasting"):
        generate(crowded, 256)

"""Reading traces: Mooncake, token and text lines; every malformed line is an error naming its line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.sim.trace import TraceError, load_trace

TRACES = Path(__file__).parents[2] / "benchmarks" / "traces"


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_the_shipped_mooncake_traces_load_with_the_published_counts() -> None:
    conversation = load_trace(TRACES / "conversation_trace.jsonl")
    assert (len(conversation.requests), conversation.accesses) == (12031, 288500)
    synthetic = load_trace(TRACES / "synthetic_trace.jsonl")
    assert (len(synthetic.requests), synthetic.accesses) == (3993, 121877)
    first = conversation.requests[0]
    assert (first.input_length, first.output_length, len(first.blocks), first.whole) == (6758, 500, 14, 13)


def test_mooncake_lines_share_blocks_by_id_and_never_store_a_partial_tail(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [7, 8]},
        {"timestamp": 5, "input_length": 10, "output_length": 0, "hash_ids": [7, 8, 9]},
    ]), block_tokens=4)
    a, b = trace.requests
    assert a.blocks == b.blocks[:2] and a.whole == 2 and b.whole == 2  # 10 tokens: two whole blocks of 4
    assert trace.accesses == 5 and trace.distinct_blocks == 2


def test_token_lines_are_keyed_by_kvtier_chunk_keys_salt_included(tmp_path: Path) -> None:
    shared = list(range(8))
    trace = load_trace(write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "token_ids": shared + [50, 51], "output_length": 1},
        {"timestamp": 1, "token_ids": shared + [60, 61, 62, 63], "output_length": 1},
        {"timestamp": 2, "token_ids": shared, "output_length": 1, "cache_salt": "tenant-b"},
        {"timestamp": 3, "token_ids": shared, "output_length": 1, "lora": "adapter"},
    ]), block_tokens=4)
    a, b, salted, lora = trace.requests
    assert (a.whole, len(a.blocks), b.whole, len(b.blocks)) == (2, 3, 3, 3)
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]
    assert not set(salted.blocks) & set(a.blocks) and not set(lora.blocks) & (set(a.blocks) | set(salted.blocks))


def test_text_lines_need_a_tokenizer_and_use_it(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [{"timestamp": 0, "prompt": "a b c d e", "output_length": 3}])
    with pytest.raises(TraceError, match=r"t.jsonl:1: prompt: a text trace needs a tokenizer"):
        load_trace(path, block_tokens=2)
    trace = load_trace(path, block_tokens=2, tokenizer=lambda text: [ord(c) for c in text.split()])
    assert trace.requests[0].input_length == 5 and trace.requests[0].whole == 2


@pytest.mark.parametrize("line, message", [
    ("{not json", r":2: not JSON"),
    ("[1, 2]", r":2: expected a JSON object, got list"),
    ({"input_length": 4, "output_length": 1, "hash_ids": [1]}, r":2: timestamp: expected a number >= 0, got None"),
    ({"timestamp": -1, "input_length": 4, "output_length": 1, "hash_ids": [1]}, r":2: timestamp: expected a number"),
    ({"timestamp": 1, "input_length": 4, "hash_ids": [1]}, r":2: output_length: expected an integer >= 0"),
    ({"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []},
     r":2: input_length: an empty prompt \(without --strict"),
    ({"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": ["x"]},
     r":2: hash_ids: expected a list of integers"),
    ({"timestamp": 1, "input_length": 9, "output_length": 1, "hash_ids": [1, 2]},
     r":2: hash_ids: 2 ids for input_length 9; blocks of 4 tokens need 3"),
    ({"timestamp": 1, "output_length": 1}, r":2: needs exactly one of hash_ids .*got none"),
    ({"timestamp": 1, "output_length": 1, "token_ids": [1], "prompt": "x"},
     r":2: needs exactly one of .*'token_ids', 'prompt'"),
    ({"timestamp": 1, "output_length": 1, "token_ids": [1, -2]}, r":2: token_ids: expected a list of integers in"),
    ({"timestamp": 1, "output_length": 1, "token_ids": [2**70]}, r":2: token_ids: expected a list of integers in"),
    ({"timestamp": 10**400, "input_length": 4, "output_length": 1, "hash_ids": [1]}, r":2: timestamp: .* too large"),
    ({"timestamp": 1, "input_length": 8, "output_length": 1, "hash_ids": [7, 7]}, r":2: hash_ids: an id repeats"),
    ({"timestamp": 1, "output_length": 1, "token_ids": []}, r":2: token_ids: an empty prompt \(without --strict"),
    ({"timestamp": 1, "output_length": 1, "token_ids": [1], "cache_salt": 5}, r":2: cache_salt: expected a string"),
    ({"timestamp": 0.5, "input_length": 4, "output_length": 1, "hash_ids": [1]},
     r":2: timestamp: 0.5 is before the previous line's 1.0"),
])
def test_a_malformed_line_names_its_line_and_field(tmp_path: Path, line, message: str) -> None:
    path = write(tmp_path / "bad.jsonl", [{"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [0]},
                                          line])
    with pytest.raises(TraceError, match=r"bad.jsonl" + message):
        load_trace(path, block_tokens=4, strict=True)


def test_lines_with_an_empty_prompt_are_skipped_and_counted_unless_strict(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    from kvtier.cli import main

    path = write(tmp_path / "agent.jsonl", [
        {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [7, 8]},
        {"timestamp": 1, "input_length": 0, "output_length": 3, "hash_ids": []},  # an agent call, no prompt
        {"timestamp": 2, "token_ids": [], "output_length": 1},
        {"timestamp": 3, "input_length": 8, "output_length": 1, "hash_ids": [7, 8]},
    ])
    trace = load_trace(path, block_tokens=4)
    assert (len(trace.requests), trace.skipped_empty, trace.accesses) == (2, 2, 4)
    with pytest.raises(TraceError, match=r"agent.jsonl:2: input_length: an empty prompt \(without --strict"):
        load_trace(path, block_tokens=4, strict=True)
    with pytest.raises(TraceError, match=r"input_length: expected an integer >= 0, got -1"):
        load_trace(write(tmp_path / "neg.jsonl", [{"timestamp": 0, "input_length": -1, "output_length": 1,
                                                   "hash_ids": []}]), block_tokens=4)
    with pytest.raises(TraceError, match=r"hash_ids: 1 ids for input_length 0"):  # no prompt, yet blocks
        load_trace(write(tmp_path / "ids.jsonl", [{"timestamp": 0, "input_length": 0, "output_length": 1,
                                                   "hash_ids": [3]}]), block_tokens=4)
    with pytest.raises(TraceError, match=r"the trace has no requests \(1 line with an empty prompt skipped\)"):
        load_trace(write(tmp_path / "none.jsonl", [{"timestamp": 0, "token_ids": [], "output_length": 1}]))
    argv = ["simulate", "--trace", str(path), "--block-tokens", "4", "--capacities", "1,2", "--no-plot"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert "skipped 2 lines of" in captured.err and "--strict refuses them" in captured.err
    assert "2 requests (2 lines with an empty prompt skipped)" in captured.out
    report = json.loads((tmp_path / "out" / "cache.json").read_text())
    assert report["trace"]["requests"] == 2 and report["trace"]["skipped_empty_prompts"] == 2
    assert main([*argv, "--out", str(tmp_path / "strict"), "--strict"]) == 2
    assert "agent.jsonl:2: input_length" in capsys.readouterr().err


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("line, message", [
    ({"timestamp": 0.5, "output_length": 1, "token_ids": []}, r":2: timestamp: 0.5 is before the previous line's 1.0"),
    ({"timestamp": 0.5, "input_length": 0, "output_length": 1, "hash_ids": []}, r":2: timestamp: 0.5 is before"),
    ({"timestamp": 1, "output_length": 1, "token_ids": [], "cache_salt": 5}, r":2: cache_salt: expected a string"),
    ({"timestamp": 1, "output_length": 1, "prompt": "", "lora": 3}, r":2: lora: expected a string"),
])
def test_a_line_with_an_empty_prompt_is_checked_before_it_is_skipped(tmp_path: Path, line, message: str,
                                                                      strict: bool) -> None:
    path = write(tmp_path / "bad.jsonl", [{"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [0]},
                                          line])
    with pytest.raises(TraceError, match=r"bad.jsonl" + message):
        load_trace(path, block_tokens=4, tokenizer=lambda text: list(text.encode()), strict=strict)


def test_a_skipped_line_keeps_its_place_in_the_arrival_order(tmp_path: Path) -> None:
    path = write(tmp_path / "order.jsonl", [{"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": [0]},
                                            {"timestamp": 5, "output_length": 1, "token_ids": []},
                                            {"timestamp": 3, "input_length": 4, "output_length": 1, "hash_ids": [1]}])
    with pytest.raises(TraceError, match=r"order.jsonl:3: timestamp: 3.0 is before the previous line's 5.0"):
        load_trace(path, block_tokens=4)


def test_unreadable_empty_and_binary_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"missing.jsonl: cannot read the trace"):
        load_trace(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match=r"empty.jsonl: the trace has no requests"):
        load_trace(tmp_path / "empty.jsonl")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match=r"bin.jsonl: not UTF-8 text"):
        load_trace(tmp_path / "bin.jsonl")
    with pytest.raises(TraceError, match=r"block_tokens: must be at least 1"):
        load_trace(TRACES / "synthetic_trace.jsonl", block_tokens=0)

"""How the simulator costs a tier's codec: the chunks a capacity holds, the bytes and seconds of a load and a store,
what a calibration without codec measurements gives, and the codecs decide weighs."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.codecs import CODECS
from kvtier.sim.codec_model import (NONE, CodecCost, UnmeasuredCodec, blocks_held, cost_of, from_calibration,
                                    split_option, weigh)

SHAPE = (30, 2, 3, 256, 64)  # SmolLM2-135M's 256-token chunk
RAW = 30 * 2 * 3 * 256 * 64 * 2
FP8 = CodecCost("fp8", False, CODECS["fp8"].max_len(SHAPE, torch.bfloat16) / RAW, 3e8, 5e8)
LOSSLESS = CodecCost("lossless", True, 0.74, 2.4e8, 3e8)
K16V8 = CodecCost("k16v8", False, 0.765625, 1.4e8, 7.5e8)


def test_fp8_holds_about_1_88_times_the_chunks_of_none_in_the_same_bytes() -> None:
    assert FP8.stored_over_raw == pytest.approx(0.53125)
    capacity = 1000 * RAW
    assert blocks_held(capacity, RAW, NONE) == 1000
    assert blocks_held(capacity, RAW, FP8) == 1882  # 1 / 0.53125
    assert blocks_held(None, RAW, FP8) is None and blocks_held(RAW // 4, RAW, FP8) == 1  # at least one


def test_a_codec_s_bytes_and_seconds() -> None:
    assert FP8.stored_bytes(RAW) == math.ceil(RAW * 0.53125)
    assert FP8.decode_s(RAW) == pytest.approx(RAW / 5e8) and FP8.encode_s(RAW) == pytest.approx(RAW / 3e8)
    assert NONE.stored_bytes(RAW) == RAW and NONE.encode_s(RAW) == 0.0 and NONE.decode_s(RAW) == 0.0


def test_a_calibration_without_codec_measurements_knows_only_none() -> None:
    assert from_calibration({"tiers": {}}) == {"none": NONE}
    with pytest.raises(UnmeasuredCodec, match=r"kvtier.tiers\[0\].codec: codec 'fp8' is not measured by the "
                                              r"calibration \(measured: none\); recalibrate with `kvtier calibrate`"):
        cost_of(from_calibration({}), "fp8", "kvtier.tiers[0].codec")


def test_a_calibration_s_codecs_and_one_this_kvtier_does_not_know() -> None:
    rows = {"fp8": {"stored_over_raw": 0.53125, "encode_bytes_per_s": 3e8, "decode_bytes_per_s": 5e8},
            "int2": {"stored_over_raw": 0.125, "encode_bytes_per_s": 1e9, "decode_bytes_per_s": 1e9}}
    costs = from_calibration({"codecs": {"by_codec": rows}})
    assert costs == {"none": NONE, "fp8": FP8}  # exactness from kvtier.codecs; an unknown codec left out
    assert cost_of(costs, "fp8", "kvtier.tiers[0].codec") == FP8


def test_decide_weighs_exact_codecs_unless_the_card_allows_lossy_kv() -> None:
    every = {"none": NONE, "fp8": FP8, "k16v8": K16V8, "lossless": LOSSLESS}
    exact = weigh(every, lossy=False, secondary=True)
    assert exact.codecs == ("lossless",) and any("lossy_kv: true" in why for why in exact.why_not)
    lossy = weigh(every, lossy=True, secondary=True)
    assert lossy.codecs == ("fp8", "k16v8", "lossless") and lossy.why_not == ()
    old = weigh({"none": NONE}, lossy=True, secondary=True)
    assert old.codecs == () and "did not measure, not weighed: fp8, k16v8, lossless" in old.why_not[0]
    assert weigh(every, lossy=True, secondary=False).codecs == ()  # DRAM alone: no tier stores coded chunks


def test_option_names_in_parts() -> None:
    assert split_option("shared:redis+fp8") == ("shared:redis", "fp8")
    assert split_option("local") == ("local", "none") and split_option("shared:a+b") == ("shared:a+b", "none")

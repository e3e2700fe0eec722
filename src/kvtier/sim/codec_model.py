"""How the simulator costs a tier's codec (``codec:`` on a tier, :mod:`kvtier.codecs`), from ``kvtier calibrate``'s
measurements of each codec (:func:`kvtier.sim.calibrate.sweep_codecs`: one thread, on a chunk of the model's KV).

- Capacity: a tier stores ``stored_over_raw`` of a chunk's bytes, so the same bytes hold ``1 / stored_over_raw``
  times the chunks (fp8: 0.531 of bfloat16 KV, 1.88 times; 0.266 of float32 KV, 3.76 times).
- A load moves the stored bytes at the tier's calibrated bandwidth, then decodes them at the codec's decode
  bandwidth (raw bytes a second). The two are added, not overlapped: the store decodes one shard while it reads
  the next ahead, so a real load can take less; an upper bound, as the timing layer's loads are.
- A store's encode runs on the cascade's writer threads, off the engine's path, with the tier write itself: the
  timing layer treats it as it treats those writes. A GPU engine loses no step time to it (its CPU time is
  reported, ``encode_cpu_s``); an engine computing on the CPU loses its cores' time, taken from the next step. A
  block reaches a shared tier after its encode and its write.

Tiers are calibrated without a codec (the raw medium), so nothing is counted twice; ``none`` costs nothing (its
copy is in the tier's measured bandwidth). A calibration made before ``kvtier calibrate`` measured codecs holds
only ``none``: a deployment naming another codec is refused (:class:`UnmeasuredCodec`), and ``kvtier decide``
says it weighed no codec. Codecs a calibration names that this kvtier does not know are left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvtier.codecs import CODECS
from kvtier.errors import KVTierError


class UnmeasuredCodec(KVTierError, ValueError):
    """A deployment names a codec its calibration did not measure: the message names the field and the measured
    codecs."""


@dataclasses.dataclass(frozen=True)
class CodecCost:
    """One codec as the timing layer costs it: the share of a chunk's raw bytes a tier stores, and the raw bytes a
    second one thread encodes and decodes (infinite: no work, as ``none``)."""

    name: str
    exact: bool
    stored_over_raw: float = 1.0
    encode_bytes_per_s: float = math.inf
    decode_bytes_per_s: float = math.inf

    def stored_bytes(self, raw_bytes: int) -> int:
        return math.ceil(raw_bytes * self.stored_over_raw)

    def encode_s(self, raw_bytes: int) -> float:
        return raw_bytes / self.encode_bytes_per_s

    def decode_s(self, raw_bytes: int) -> float:
        return raw_bytes / self.decode_bytes_per_s


NONE = CodecCost("none", exact=True)


def from_calibration(calibration: Mapping[str, Any]) -> dict[str, CodecCost]:
    """``none`` and every codec the calibration measured (its ``codecs.by_codec``, checked by
    :func:`kvtier.sim.calibrate.load_calibration`), by name."""
    measured = (calibration.get("codecs") or {}).get("by_codec", {})
    out = {"none": NONE}
    for name, row in sorted(measured.items()):
        if name in CODECS and name != "none":
            out[name] = CodecCost(name, CODECS[name].exact, float(row["stored_over_raw"]),
                                  float(row["encode_bytes_per_s"]), float(row["decode_bytes_per_s"]))
    return out


def cost_of(costs: Mapping[str, CodecCost], codec: str, field: str) -> CodecCost:
    """The cost of ``codec`` (named at ``field`` of a deployment); :class:`UnmeasuredCodec` if not measured."""
    if codec not in costs:
        raise UnmeasuredCodec(f"{field}: codec {codec!r} is not measured by the calibration (measured: "
                              f"{', '.join(sorted(costs))}); recalibrate with `kvtier calibrate`, which measures "
                              "every codec's encode and decode")
    return costs[codec]


def blocks_held(capacity_bytes: int | None, chunk_bytes: int, codec: CodecCost) -> int | None:
    """The chunks of ``chunk_bytes`` raw bytes a tier of ``capacity_bytes`` holds with ``codec`` (None: unbounded);
    at least one."""
    return None if capacity_bytes is None else max(1, capacity_bytes // codec.stored_bytes(chunk_bytes))


LOSSY = tuple(name for name, codec in CODECS.items() if not codec.exact)


@dataclasses.dataclass(frozen=True)
class Weighed:
    """The codecs ``kvtier decide`` times on an option's tiers besides DRAM (besides none), and why it times no
    others."""

    codecs: tuple[str, ...]
    why_not: tuple[str, ...]


def weigh(costs: Mapping[str, CodecCost], lossy: bool, secondary: bool) -> Weighed:
    """The codecs measured (``costs``), of those only the exact ones unless the workload allows ``lossy`` KV; none
    without a ``secondary`` tier (DRAM holds chunks as they are)."""
    if not secondary:
        return Weighed((), ("no codec weighed: no tier besides DRAM (a codec applies to the disk and shared tiers)",))
    allowed = [name for name, codec in sorted(CODECS.items()) if name != "none" and (lossy or codec.exact)]
    why = []
    if missing := [name for name in allowed if name not in costs]:
        why.append(f"codecs the calibration did not measure, not weighed: {', '.join(missing)} (recalibrate with "
                   "`kvtier calibrate`, which measures them)")
    if not lossy:
        why.append(f"lossy codecs ({', '.join(LOSSY)}) not weighed: the card does not allow lossy KV (lossy_kv: "
                   "true allows it)")
    return Weighed(tuple(name for name in allowed if name in costs), tuple(why))


class OptionName(NamedTuple):
    """A decide option's name in parts: ``shared:redis+fp8`` is placement ``shared:redis``, codec ``fp8``."""

    placement: str
    codec: str


def split_option(name: str) -> OptionName:
    placement, plus, codec = name.rpartition("+")
    return OptionName(placement, codec) if plus and codec in CODECS else OptionName(name, "none")

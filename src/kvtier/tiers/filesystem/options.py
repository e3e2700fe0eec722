"""The filesystem tier's options: what a config may say, checked at load time."""

from __future__ import annotations

import dataclasses
from typing import Literal

from kvtier.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class FilesystemOptions:
    """The keys of a ``type: filesystem`` tier: a directory on a local disk."""

    path: str = dataclasses.field(metadata={"help": "the directory that holds the tier's files"})
    capacity_bytes: int | None = dataclasses.field(default=None, metadata={
        "help": "the bytes the tier may hold; null: unlimited"})
    high_watermark: float = dataclasses.field(default=0.95, metadata={
        "help": "evict when usage passes high_watermark x capacity_bytes ..."})
    low_watermark: float = dataclasses.field(default=0.85, metadata={
        "help": "... down to low_watermark x capacity_bytes, least recently used first"})
    ttl_seconds: float | None = dataclasses.field(default=None, metadata={
        "help": "remove chunks written longer ago than this (never served older); null: no limit"})
    durability: Literal["none", "fsync"] = dataclasses.field(default="none", metadata={
        "help": "fsync: fsync the file and its directory before a write counts"})
    rescan_seconds: float | None = dataclasses.field(default=60.0, metadata={
        "help": "with a capacity or TTL: walk the directory this often, so files other processes (TP workers, "
                "other engines) wrote count against the limits too; null: never"})

    def check(self, field: str) -> None:
        if self.rescan_seconds is not None and self.rescan_seconds <= 0:
            raise ConfigError(f"{field}.rescan_seconds: must be positive or null, got {self.rescan_seconds}")
        if not self.path.strip():
            raise ConfigError(f"{field}.path: must name a directory, got an empty path")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError(f"{field}.low_watermark/high_watermark: need 0 < low <= high <= 1, got "
                              f"{self.low_watermark} and {self.high_watermark}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ConfigError(f"{field}.capacity_bytes: must be positive, got {self.capacity_bytes}")
        if self.ttl_seconds is not None and self.ttl_seconds <= 0:
            raise ConfigError(f"{field}.ttl_seconds: must be positive, got {self.ttl_seconds}")

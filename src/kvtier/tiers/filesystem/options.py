"""The filesystem tier's options: what a config may say, checked at load time."""

from __future__ import annotations

import dataclasses
from typing import Literal

from kvtier.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class FilesystemOptions:
    path: str
    capacity_bytes: int | None = None
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    ttl_seconds: float | None = None
    durability: Literal["none", "fsync"] = "none"
    rescan_seconds: float | None = 60.0

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

"""How kvtier prints byte sizes: one formatter, so a size reads the same in the CLI, the decider's reports and
the placement rules' descriptions."""

from __future__ import annotations

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def size_label(n: float, digits: int | None = 3) -> str:
    """``n`` bytes in the largest binary unit it reaches: ``1.5 GiB`` (``digits`` significant digits), or with
    ``digits=None`` as many as it takes (``1.25 GiB``, ``512 MiB``). Under 1 KiB: ``812 B``."""
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            return f"{n / scale:g} {unit}" if digits is None else f"{n / scale:.{digits}g} {unit}"
    return f"{n:.0f} B"


def size_fixed(n: float) -> str:
    """``n`` bytes with one decimal in the largest unit it reaches (``1.5 GiB``, ``0 B``): a column of sizes
    (``kvtier cache ls``), where each row shows the same precision."""
    for unit, scale in _UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"

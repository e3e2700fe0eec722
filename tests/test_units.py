"""The one size formatter."""

from __future__ import annotations

import pytest

from kvtier.units import size_fixed, size_label


@pytest.mark.parametrize(("n", "label", "exact", "fixed"), [
    (0, "0 B", "0 B", "0 B"),
    (812, "812 B", "812 B", "812 B"),
    (1536, "1.5 KiB", "1.5 KiB", "1.5 KiB"),
    (512 * 2**20, "512 MiB", "512 MiB", "512.0 MiB"),
    (int(1.25 * 2**30), "1.25 GiB", "1.25 GiB", "1.2 GiB"),
    (3 * 2**40, "3 TiB", "3 TiB", "3.0 TiB"),
])
def test_sizes_print_in_the_largest_binary_unit(n: int, label: str, exact: str, fixed: str) -> None:
    assert (size_label(n), size_label(n, digits=None), size_fixed(n)) == (label, exact, fixed)

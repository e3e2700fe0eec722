"""``kvtier bench``'s arguments (:mod:`kvtier.cli.bench`); the benchmark itself is tested in tests/bench."""

from __future__ import annotations

import pytest

from kvtier.cli import main


@pytest.mark.parametrize("value, error", [("8032", "8032: must be a multiple of 64 from 1024 to 32768"),
                                          ("65536", "65536: must be a multiple of 64"),
                                          ("16k", "not a whole number: '16k'")])
def test_bench_refuses_a_bad_prefix_length(value: str, error: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--prefix-tokens", value])
    assert exit_info.value.code == 2
    assert f"--prefix-tokens: {error}" in capsys.readouterr().err

"""The ``kvtier`` entry points (:mod:`kvtier.cli`): the installed console script and ``python -m kvtier.cli``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_console_script_is_installed(config: Path) -> None:
    exe = Path(sys.executable).with_name("kvtier")
    result = subprocess.run([str(exe), "cache", "stats", "--config", str(config)], capture_output=True, text=True,
                            env={**os.environ})
    assert result.returncode == 0 and "objects:" in result.stdout


def test_python_m_runs_the_cli(config: Path) -> None:
    """``python -m kvtier.cli``: how the fleet starts its router in a child process."""
    result = subprocess.run([sys.executable, "-m", "kvtier.cli", "cache", "stats", "--config", str(config)],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "objects:" in result.stdout

"""What the peer benchmark records about where it ran: the machine, the package versions and the git commit."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path

PACKAGES = ("kvtier", "lmcache", "torch", "numpy", "redis", "hiredis")


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.rstrip("\n")
    except (OSError, subprocess.TimeoutExpired):
        return ""


def describe() -> dict:
    """``lscpu`` (as fields), ``nproc``, memory, kernel and Python, and a one-line summary."""
    lscpu = {}
    for line in _run(["lscpu"]).splitlines():
        key, sep, value = line.partition(":")
        if sep:
            lscpu[key.strip()] = value.strip()
    mem_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    nproc = _run(["nproc"])
    model = lscpu.get("Model name", platform.processor() or "unknown CPU")
    return {
        "summary": f"{model}, nproc {nproc}, {mem_kib / 2**20:.0f} GiB RAM, {platform.system()} "
                   f"{platform.release()}, Python {platform.python_version()}",
        "nproc": nproc, "os_cpu_count": os.cpu_count(), "mem_total_kib": mem_kib, "lscpu": lscpu,
        "platform": platform.platform(), "python": platform.python_version(),
    }


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    binary = shutil.which("redis-server")
    found["redis-server"] = _run([binary, "--version"]) if binary else None
    return found


def git_state(repo: Path) -> dict:
    """The commit, and the files changed since it: the benchmark runs the working tree, not the commit."""
    changed = _run(["git", "-C", str(repo), "status", "--porcelain", "--", "src", "pyproject.toml"]).splitlines()
    return {"commit": _run(["git", "-C", str(repo), "rev-parse", "HEAD"]), "uncommitted_in_src": changed}

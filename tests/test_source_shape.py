"""The source's shape rules (STYLE.md, issue 27), checked on every run: no module of kvtier over 600 lines, no
class over 400, no function over 80, and every ``noqa`` / ``type: ignore`` saying why."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvtier

SRC = Path(kvtier.__file__).parent
LIMITS = {"module": 600, "class": 400, "function": 80}


def _sizes() -> list[tuple[str, str, int]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(SRC.parent))
        found.append(("module", name, len(text.splitlines())))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                found.append(("class", f"{name}:{node.name}", node.end_lineno - node.lineno + 1))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append(("function", f"{name}:{node.name}", node.end_lineno - node.lineno + 1))
    return found


def test_no_module_class_or_function_is_over_its_limit() -> None:
    over = [f"{kind} {name}: {lines} lines (at most {LIMITS[kind]})" for kind, name, lines in _sizes()
            if lines > LIMITS[kind]]
    assert not over, "\n".join(over)


def test_the_checker_sees_every_kind() -> None:
    kinds = {kind for kind, _, _ in _sizes()}
    assert kinds == set(LIMITS)
    assert any(name.endswith("kvstore.py:KVStore") for _, name, _ in _sizes())


def test_every_suppression_says_why() -> None:
    """A ``# noqa: CODE`` or ``# type: ignore[code]`` is followed by its reason on the same line."""
    bare = re.compile(r"#\s*(noqa(:\s*[A-Z]+[0-9]+(,\s*[A-Z]+[0-9]+)*)?|type:\s*ignore(\[[a-z-, ]+\])?)\s*$")
    found = [f"{path.relative_to(SRC.parent)}:{i}: {line.strip()}"
             for path in sorted(SRC.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if bare.search(line)]
    assert not found, "\n".join(found)

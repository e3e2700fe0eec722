"""The long-document QA workload (modelled on LMCache's benchmark): documents of real text, each asked
several questions, in an order that cycles through all documents so the engine's own KV memory cannot keep them.

The text is the documentation of Python's standard library (docstrings), so the workload needs no download.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

_MODULES = ("argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv", "dataclasses",
            "datetime", "decimal", "email.message", "functools", "http.client", "http.server", "inspect",
            "itertools", "json", "logging", "multiprocessing", "os", "pathlib", "pickle", "re", "shutil",
            "socket", "sqlite3", "ssl", "statistics", "string", "subprocess", "tarfile", "tempfile",
            "textwrap", "threading", "typing", "unittest", "urllib.request", "uuid", "zipfile")
QUESTIONS = ("Summarize the document above in one sentence.", "What is the main purpose of this module?",
             "List three functions or classes the document describes.", "What should a beginner read first?")


@dataclass(frozen=True)
class Request:
    doc: int
    question: int
    tokens: list[int]


def corpus() -> str:
    parts = []
    for name in _MODULES:
        module = importlib.import_module(name)
        for obj in [module, *(v for _, v in sorted(vars(module).items()) if inspect.isclass(v) or
                              inspect.isfunction(v))]:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                parts.append(doc)
    return "\n\n".join(parts)


def documents(tokenizer, count: int, doc_tokens: int) -> list[list[int]]:
    """``count`` documents of exactly ``doc_tokens`` tokens of real text, all different."""
    ids = tokenizer(corpus(), add_special_tokens=False)["input_ids"]
    if len(ids) < count * doc_tokens:
        raise RuntimeError(f"corpus has {len(ids)} tokens, the workload needs {count * doc_tokens}")
    return [ids[i * doc_tokens:(i + 1) * doc_tokens] for i in range(count)]


def requests(tokenizer, docs: list[list[int]], rounds: int) -> list[Request]:
    """Round r asks question r about every document, documents in order: each document comes back only after
    all the others, which is what defeats an engine KV memory smaller than all documents together."""
    out = []
    for r in range(rounds):
        q = tokenizer("\n\nQuestion: " + QUESTIONS[r % len(QUESTIONS)] + "\nAnswer:",
                      add_special_tokens=False)["input_ids"]
        for d, doc in enumerate(docs):
            out.append(Request(d, r, doc + q))
    return out


def suffixes(tokenizer, count: int, length: int = 16) -> list[list[int]]:
    """``count`` questions of ``length`` tokens each (the length of :func:`requests`' questions, so a hit's cost is
    measured on the same prompt shape), all different: each asks about its own window of real text from the
    corpus's end (the documents come from its start)."""
    ids = tokenizer(corpus(), add_special_tokens=False)["input_ids"]
    head = tokenizer("\n\nQuestion: What does it say of", add_special_tokens=False)["input_ids"]
    tail = tokenizer("?\nAnswer:", add_special_tokens=False)["input_ids"]
    window = length - len(head) - len(tail)
    if window < 1:
        raise ValueError(f"suffixes: length {length} leaves no room for text; at least {len(head) + len(tail) + 1}")
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    end = len(ids)
    while len(out) < count:  # windows back from the corpus's end, each one not taken before
        if end - window < 0:
            raise RuntimeError(f"corpus has {len(seen)} different windows of {window} tokens, the suffixes need "
                               f"{count}")
        text = tuple(ids[end - window:end])
        end -= window
        if text not in seen:
            seen.add(text)
            out.append([*head, *text, *tail])
    return out

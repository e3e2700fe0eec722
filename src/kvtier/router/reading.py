"""A request body's CPU work, on a worker thread of :class:`kvtier.router.guards.WorkerPool`: parse it, read its
prompt as the engine will (:mod:`kvtier.router.prompts`) and key it. Nothing here touches the event loop's state
but the policy's pure :meth:`Router.keys`."""

from __future__ import annotations

import dataclasses
import json

from kvtier.router.metrics import LogOnce
from kvtier.router.policy import Router
from kvtier.router.prompts import Prompt, PromptError, Tokenizer, read_prompt

# A body this many bytes a token of the longest prompt keyed is not tokenized (routed without a prediction): no
# tokenizer averages 64 bytes a token over a prompt (text is ~4, JSON-escaped CJK ~6), so its prompt is longer
# than that; tokenizing it would only hold a worker.
BYTES_PER_TOKEN = 64


@dataclasses.dataclass(frozen=True)
class Read:
    """A request's body as a worker read it: parsed, its prompt tokenized and keyed (None and no keys: routed
    without a prediction)."""

    body: dict
    raw: bytes  # what is sent to the engine
    prompt: Prompt | None
    keys: list[bytes]


class Unreadable(Exception):
    """The body is not a JSON object: a 400 of the router's own."""


class Reader:
    def __init__(self, tokenizer: Tokenizer, router: Router, unpredicted: LogOnce) -> None:
        self._tokenizer, self._router, self._unpredicted = tokenizer, router, unpredicted

    def __call__(self, path: str, raw: bytes, base_models: set[str], longest: int) -> Read:
        """``longest``: the most prompt tokens keyed (limits.max_prompt_tokens, the engines' max_model_len).
        Raises :class:`Unreadable` for a body that is not a JSON object."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise Unreadable("the request body is not JSON") from None
        if not isinstance(body, dict):
            raise Unreadable("the request body must be a JSON object")
        xargs = body.get("vllm_xargs")
        if isinstance(xargs, dict) and "kv_cache_report_mode" in xargs:
            # "full" makes the engine announce reused blocks again without removing them: the index counts
            # references, and would credit evicted blocks for good. The router owns what engines announce.
            body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != "kv_cache_report_mode"}
            raw = json.dumps(body).encode()
        prompt = self._prompt(path, body, len(raw), base_models, longest)
        return Read(body=body, raw=raw, prompt=prompt, keys=self._router.keys(prompt) if prompt is not None else [])

    def _prompt(self, path: str, body: dict, size: int, base_models: set[str], longest: int) -> Prompt | None:
        """The request's prompt, or None: the engine answers it as it sees fit (a prompt longer than it takes,
        with its own validation error)."""
        if size > longest * BYTES_PER_TOKEN:
            self._unpredicted("too_long", "a request of %d bytes routed without a prediction: over %d bytes for "
                              "each of the %d prompt tokens keyed at most, it is not tokenized", size,
                              BYTES_PER_TOKEN, longest)
            return None
        try:
            prompt = read_prompt(self._tokenizer, path, body, base_models)
        except (PromptError, RecursionError) as exc:
            # the message may quote the client's text: %r escapes its newlines
            self._unpredicted("unreadable", "a request routed without its cache: %r", str(exc)[:500])
            return None
        except Exception as exc:  # a tokenizer's own failure: routed all the same, counted
            self._unpredicted("failed", "reading a request's prompt failed (%s: %r); routed without its cache",
                              type(exc).__name__, str(exc)[:500])
            return None
        if len(prompt.tokens) > longest:
            self._unpredicted("too_long", "a prompt of %d tokens routed without a prediction: over %d "
                              "(limits.max_prompt_tokens, or the engines' max_model_len)", len(prompt.tokens), longest)
            return None
        return prompt

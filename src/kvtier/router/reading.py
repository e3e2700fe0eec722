"""A request body's CPU work, on a worker thread of :class:`kvtier.router.guards.WorkerPool` (or on the event loop
where that costs less: :meth:`Reader.cheap`): parse it, read its prompt as the engine will
(:mod:`kvtier.router.prompts`) and key it; or, with every worker busy, only parse it (:meth:`Reader.unpredicted`,
on the loop). Nothing here touches the event loop's state but the policy's pure
:meth:`Router.keys`."""

from __future__ import annotations

import dataclasses
import json

from kvtier.router.metrics import LogOnce
from kvtier.router.policy import Router
from kvtier.router.prompts import Prompt, PromptError, Tokenizer, read_prompt, read_stream

# A body over this many bytes a token of the longest prompt keyed is not tokenized (routed without a prediction):
# it bounds a request's tokenizing at 16 x max_prompt_tokens bytes (2 MiB at the default). What a token takes in a
# body: ~4 bytes of English or code, up to 12 for CJK (each character "\uXXXX" in JSON, two characters a token);
# only long runs of one character take more (64 bytes a token of "=" for SmolLM2, whose longest token is 81
# bytes). So a body over the bound either has more tokens than are keyed (routed without a prediction anyway) or
# is such a run, which loses only its prediction.
BYTES_PER_TOKEN = 16
# A completion body up to this size is read on the event loop (:meth:`Reader.cheap`): any text of 1 KiB tokenizes in
# at most 0.33 ms here (runs of one character, CJK, digits: a fast tokenizer), and with blocks of at least
# INLINE_BLOCK tokens it has at most 64 keys (0.14 ms); the hop to a worker thread and back cost a short prompt
# 0.4-0.6 ms of its TTFT beside busy engines. A chat's template runs first: always on a worker.
INLINE_BYTES = 1024
INLINE_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class Read:
    """A request's body as a worker read it: parsed, its prompt tokenized and keyed (None and no keys: routed
    without a prediction)."""

    stream: bool  # as vLLM reads it ("false" is false); the parsed body itself is not kept
    raw: bytes  # what is sent to the engine
    prompt: Prompt | None
    keys: list[bytes]


class Unreadable(Exception):
    """The body is not a JSON object: a 400 of the router's own."""


class Reader:
    def __init__(self, tokenizer: Tokenizer, router: Router, unpredicted: LogOnce) -> None:
        self._tokenizer, self._router, self._unpredicted = tokenizer, router, unpredicted
        self._inline = getattr(tokenizer, "fast", False) and router.config.block_size >= INLINE_BLOCK

    def cheap(self, path: str, size: int) -> bool:
        """Whether a body of ``size`` bytes to ``path`` is read on the event loop: a completion of at most
        :data:`INLINE_BYTES`, a fast tokenizer, blocks of at least :data:`INLINE_BLOCK` tokens."""
        return self._inline and size <= INLINE_BYTES and not path.endswith("/chat/completions")

    def __call__(self, path: str, raw: bytes, base_models: set[str], longest: int) -> Read:
        """``longest``: the most prompt tokens keyed (limits.max_prompt_tokens, the engines' max_model_len).
        Raises :class:`Unreadable` for a body that is not a JSON object."""
        body, raw = _parse(raw)
        prompt = self._prompt(path, body, len(raw), base_models, longest)
        return Read(stream=read_stream(body), raw=raw, prompt=prompt,
                    keys=self._router.keys(prompt) if prompt is not None else [])

    def unpredicted(self, raw: bytes, kind: str) -> Read:
        """The body parsed, its prompt not read (routed without a prediction, counted under ``kind``)."""
        body, raw = _parse(raw)
        self._unpredicted(kind, "a request routed without a prediction (%s)", _WHY.get(kind, kind))
        return Read(stream=read_stream(body), raw=raw, prompt=None, keys=[])

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
        except Exception as exc:  # noqa: BLE001 a tokenizer's own failure: routed all the same, counted and logged
            self._unpredicted("failed", "reading a request's prompt failed (%s: %r); routed without its cache",
                              type(exc).__name__, str(exc)[:500])
            return None
        if len(prompt.tokens) > longest:
            self._unpredicted("too_long", "a prompt of %d tokens routed without a prediction: over %d "
                              "(limits.max_prompt_tokens, or the engines' max_model_len)", len(prompt.tokens), longest)
            return None
        return prompt


_WHY = {"busy": "every worker was busy (limits.workers, limits.queue)"}


def _parse(raw: bytes) -> tuple[dict, bytes]:
    """The body as a JSON object, and the bytes to send the engine. Raises :class:`Unreadable`."""
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
    if "kv_transfer_params" in body:
        # What passes between engines is the router's to say: a client's kvtier fields would make a decode engine
        # wait for KV no prefill stored; vLLM's own would replace the prompt the router keyed (prompt_token_ids)
        # or claim cached tokens computed elsewhere (do_remote_prefill)
        del body["kv_transfer_params"]
        raw = json.dumps(body).encode()
    return body, raw

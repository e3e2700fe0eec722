"""A request's prompt as the engine will see it: token ids, LoRA name, cache salt, and whether a cached prefix can
be predicted for it.

The router reads a body the way vLLM's OpenAI server does (vLLM 0.32: ``CompletionRequest`` and
``ChatCompletionRequest``, then its renderer):

- Fields by pydantic's lax rules (:func:`read_bool`, :func:`read_int`): ``"stream": "false"`` is false. A value vLLM
  refuses with a 400, or one the router cannot be sure it reads as vLLM does, raises :class:`FieldError`: the
  request goes without a prediction and the engine answers it.
- A chat is rendered with the model directory's own template only. A template in the request (``chat_template``,
  or ``chat_template_kwargs.chat_template``) is never compiled nor rendered: vLLM refuses it unless started with
  ``--trust-request-chat-template``, and either way the router cannot predict it. Of ``chat_template_kwargs`` only
  the variables the template reads are passed, merged as vLLM merges them, and only plain JSON of bounded size,
  so a client cannot make the router's own template loop over or copy a large value.
- Tokens as vLLM's renderer makes them: a completion's text with special tokens, a chat's rendered text without
  (``add_special_tokens`` either way), then ``truncate_prompt_tokens`` keeps the last tokens (vLLM loads a
  generating model's tokenizer with truncation side "left") or those ``truncation_side`` names.
- No cached prefix is predicted (:class:`Uncached`) where vLLM reads none, or the router cannot key the prompt.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

_INT64_MAX = 2**63 - 1
_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})  # vLLM's reasoning_effort values
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})  # pydantic's lax bool strings, in any case
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_DIGITS = re.compile(r"[+-]?[0-9]{1,19}")
# chat_template_kwargs the router never renders with: a template of the request's, and names vLLM refuses or
# treats apart (``tokenize``: the template's output is tokens; the others collide with the renderer's own).
_UNMODELLED = ("chat_template", "tokenize", "messages", "conversation", "self")
CUTTERS = 8  # at most this many truncating copies of the tokenizer for the workers (see Tokenizer)
# What transformers' call on a fast tokenizer runs (besides itself) to encode a text: a class overriding one of these
# is called, not bypassed (:func:`rust_encoder`)
_CALLED = ("_get_padding_truncation_strategies", "_encode_plus", "set_truncation_and_padding", "_convert_encoding")
# Texts a fast tokenizer's backend and its call must encode alike, at load, before the router encodes with the
# backend: empty, leading and inner spaces, special tokens of several families written in the text, characters of
# several bytes, whitespace runs
_PROBES = ("", "  Hello there,  world", "<|im_start|>user\n<s>[INST]</s><|endoftext|>", "naïve 東京 🙂\n\n\t x")
_KWARGS_BUDGET = 16384  # characters and items in the template-read chat_template_kwargs: more, no prediction
_KWARGS_MAX_INT = 65536  # an integer a template could loop over: larger ones, no prediction


class Uncached(enum.Enum):
    """Why no cached prefix is predicted for a prompt the router read: as far as it can tell, the engine computes
    all of it."""

    PROMPT_LOGPROBS = "prompt_logprobs"  # vLLM (and kvtier's connector) skip reading the cache for it
    CONTENT_PARTS = "content_parts"  # images, audio...: the engine's tokens and block hashes are not the text's
    TRUNCATED_TO_LIMIT = "truncate_prompt_tokens"  # -1: cut to the engine's max_model_len, unknown here

    @property
    def stored(self) -> bool:
        """The router's tokens are the engine's: the engine stores their blocks (so they may be reserved)."""
        return self is Uncached.PROMPT_LOGPROBS


@dataclasses.dataclass(frozen=True)
class Prompt:
    tokens: Sequence[int]  # as the engine computes them; with CONTENT_PARTS, the text's alone (a count)
    lora_name: str | None = None
    cache_salt: str | None = None
    uncached: Uncached | None = None  # set: no cached prefix is predicted, for this reason


class PromptError(ValueError):
    """The body has no prompt the router can read; the request is routed without its cache."""


class FieldError(PromptError):
    """A field vLLM refuses (a 400 there), or one the router cannot be sure it reads as vLLM does."""


@dataclasses.dataclass(frozen=True)
class Truncation:
    """``truncate_prompt_tokens`` and ``truncation_side`` as vLLM applies them."""

    keep: int | None = None  # tokens kept; None: all; -1: the engine's limit (not applied here)
    side: str | None = None  # "left" keeps the last, "right" the first; None: the tokenizer's (left)


def read_bool(body: Mapping[str, object], name: str, default: bool, *, nullable: bool = False) -> bool:
    """``body[name]`` as pydantic reads a ``bool`` field of vLLM's request models: true/false, 0/1, and the strings
    "true"/"false", "yes"/"no", "on"/"off", "t"/"f", "y"/"n", "1"/"0" in any case. ``nullable``: the field is
    ``bool | None`` and null reads false, as vLLM tests it. Anything else raises :class:`FieldError`."""
    value = body.get(name, default)
    if value is None and nullable:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.isascii():
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
    raise FieldError(f"{name}: expected a boolean (true or false, 0 or 1, or one of the strings "
                     f"{', '.join(sorted(_TRUE | _FALSE))}); got a {type(value).__name__} vLLM refuses")


def read_int(body: Mapping[str, object], name: str, low: int, high: int = _INT64_MAX) -> int | None:
    """``body[name]`` as pydantic reads an ``int | None`` field between ``low`` and ``high``: an integer, a float
    without a fraction, a bool, or a string of digits. Other strings pydantic takes ("1_000", " 5", "5.0") raise
    :class:`FieldError` too: the router predicts nothing rather than read them another way."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, (bool, int)) or (isinstance(value, float) and value.is_integer()) or (
            isinstance(value, str) and _DIGITS.fullmatch(value)):
        number = int(value)
    else:
        raise FieldError(f"{name}: expected an integer from {low} to {high}; got a {type(value).__name__}")
    if not low <= number <= high:
        raise FieldError(f"{name}: expected an integer from {low} to {high}")
    return number


def read_stream(body: Mapping[str, object]) -> bool:
    """Whether the engine streams its answer, as vLLM reads ``stream``. A value vLLM refuses reads false: the
    engine answers it at once with a 400, which must not be timed as a streamed prefill."""
    try:
        return read_bool(body, "stream", False, nullable=True)
    except FieldError:
        return False


def read_truncation(body: Mapping[str, object]) -> Truncation:
    keep = read_int(body, "truncate_prompt_tokens", -1)
    if keep == 0:
        raise FieldError("truncate_prompt_tokens: 0 keeps no prompt; expected -1 or a positive number")
    side = body.get("truncation_side")
    if side not in (None, "left", "right"):
        raise FieldError("truncation_side: expected 'left' or 'right'")
    return Truncation(keep, side)


class Tokenizer:
    def __init__(self, model_dir: str, cutters: int = 2) -> None:
        from transformers import AutoTokenizer  # heavy: only the router needs it

        # Truncation side "left": vLLM loads a generating model's tokenizer so (truncate_prompt_tokens keeps the
        # prompt's end)
        self._tok = AutoTokenizer.from_pretrained(model_dir, truncation_side="left")
        self.fast = bool(getattr(self._tok, "is_fast", False))  # its encoding runs in Rust (a Python one may not)
        backend = getattr(self._tok, "_tokenizer", None)
        if backend is not None and backend.truncation is not None:
            # A tokenizer.json that truncates: the first call would unset it, which needs the tokenizer to itself
            # while the other threads encode with it
            backend.no_truncation()
        # transformers' plain fast tokenizer is called as its Rust backend, set up as its __call__ sets it up: the
        # Python around the encode costs 5x the encode itself (20 against 4 us warm), and 0.5 against 0.2 ms when
        # the router's code runs cold after an engine's answer, as it does for every short request. The event
        # loop's thread (see below; it encodes short texts only) calls encode, which holds the GIL; a worker calls
        # encode_batch, which does not (a long prompt must not stop the loop).
        self._rust = rust_encoder(self._tok)
        # A request that truncates sets the tokenizer's truncation, and the next call unsets it: on a tokenizer
        # shared by threads (the workers, the event loop) that would truncate another thread's prompt, or fail
        # ("Already borrowed") while it encodes. The shared one never truncates: a copy does (0.1 s and 8 MiB
        # each for SmolLM2's, more for a larger vocabulary). The event loop's thread (the one making this, or
        # the one calling :meth:`on_loop`) has its own, made now: it never waits for one. The workers take one of
        # ``cutters`` (the router gives min(limits.workers, CUTTERS)), made as first needed, and wait for one while
        # all are in use: truncating prompts are encoded ``cutters`` at a time, whatever the worker count.
        self._owner = threading.get_ident()
        self._own = copy.deepcopy(self._tok)
        self._cutters = threading.BoundedSemaphore(cutters)
        self._lock = threading.Lock()
        self._spare: list[Any] = []  # the copies made, each back here once its encode ends

    def completion(self, body: Mapping[str, object]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of prompts: route by the first
        truncation = read_truncation(body)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                                            for t in prompt):
            return _cut(list(prompt), truncation)
        if isinstance(prompt, str):
            return self._encode(prompt, read_bool(body, "add_special_tokens", True), truncation)
        raise PromptError("prompt: expected a string, a list of token ids, or a list of those")

    def chat(self, body: Mapping[str, object]) -> list[int]:
        return self._encode(self._render(body), read_bool(body, "add_special_tokens", False), read_truncation(body))

    def _encode(self, text: str, add_special_tokens: bool, truncation: Truncation) -> list[int]:
        """Tokens of ``text`` as vLLM's renderer encodes a text prompt (``TokenizeParams.get_encode_kwargs``)."""
        keep = truncation.keep
        if keep is not None and keep > 0 and truncation.side is None:
            # The tokenizer truncates (keeping the special tokens it adds), as vLLM has it do
            return self._truncated(text, add_special_tokens, keep)
        if self._rust is not None:
            if threading.get_ident() == self._owner:
                encoded = self._rust.encode(text, add_special_tokens=add_special_tokens)
            else:
                encoded = self._rust.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            return _cut(encoded.ids, truncation)
        return _cut(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"], truncation)

    def on_loop(self) -> None:
        """Called on the event loop's thread: that thread truncates with the copy of its own from now on."""
        self._owner = threading.get_ident()

    def _truncated(self, text: str, add_special_tokens: bool, keep: int) -> list[int]:
        """``text`` encoded by a truncating copy of the tokenizer that no other thread uses meanwhile."""
        def encode(cutter: Any) -> list[int]:
            return cutter(text, add_special_tokens=add_special_tokens, truncation=True, max_length=keep)["input_ids"]

        if threading.get_ident() == self._owner:
            return encode(self._own)
        with self._cutters:  # at most CUTTERS in use, so at most CUTTERS made
            with self._lock:
                cutter = self._spare.pop() if self._spare else None
            if cutter is None:
                cutter = copy.deepcopy(self._tok)
            try:
                return encode(cutter)
            finally:
                with self._lock:
                    self._spare.append(cutter)

    def _render(self, body: Mapping[str, object]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise PromptError("messages: expected a list of message objects")
        client = body.get("chat_template_kwargs") or {}
        if not isinstance(client, Mapping):
            raise FieldError("chat_template_kwargs: expected an object")
        # Never compiled, never rendered: the router's template is the model directory's
        if body.get("chat_template") is not None or client.get("chat_template") is not None:
            raise FieldError("chat_template: a template in the request is not rendered by the router (vLLM refuses "
                             "one unless started with --trust-request-chat-template)")
        kwargs = _template_kwargs(body, client)
        for name in _UNMODELLED:
            if name in kwargs:
                raise FieldError(f"chat_template_kwargs.{name}: not rendered by the router")
        # passed to transformers as keywords it types one by one; their values were checked here
        fixed: dict[str, Any] = {k: kwargs.pop(k, None) for k in ("tools", "documents")}
        fixed.update({k: kwargs.pop(k) for k in ("add_generation_prompt", "continue_final_message")})
        if fixed["tools"] is not None and not isinstance(fixed["tools"], list):
            raise FieldError("tools: expected a list")
        try:  # the model's own (its "tool_use" one, where it has one, for a request with tools)
            template = self._tok.get_chat_template(None, fixed["tools"])
        except ValueError as exc:
            raise PromptError("the model directory has no chat template") from exc
        read = _template_variables(template)
        # what the template never reads changes nothing
        passed: dict[str, Any] = {k: v for k, v in kwargs.items() if k in read}
        if _size(passed, _KWARGS_BUDGET) > _KWARGS_BUDGET:
            raise FieldError(f"chat_template_kwargs: more than {_KWARGS_BUDGET} characters and items (or an "
                             f"integer over {_KWARGS_MAX_INT}) for the template; routed without a prediction")
        conversation = [{**m, "content": _text(m.get("content"))} for m in messages]
        try:
            text = self._tok.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                 **fixed, **passed)
        except Exception as exc:  # a template's own error (jinja2 raises several kinds): not a routable prompt
            raise PromptError(f"the chat template failed: {str(exc)[:200]!r}") from exc
        assert isinstance(text, str), "tokenize=False renders one conversation to one text"
        return text


def _template_kwargs(body: Mapping[str, object], client: Mapping[str, object]) -> dict[str, object]:
    """chat_template_kwargs as vLLM 0.32 merges them (``ChatCompletionRequest.build_chat_params``, then
    ``ChatParams.with_defaults``): the request's own fields over the client's kwargs, the request's tools under
    them, and no value that is null or "auto"."""
    generation = read_bool(body, "add_generation_prompt", True)
    continue_final = read_bool(body, "continue_final_message", False)
    if generation and continue_final:
        raise FieldError("add_generation_prompt, continue_final_message: not both true")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in _EFFORTS:
        raise FieldError(f"reasoning_effort: expected one of {', '.join(sorted(_EFFORTS))}")
    documents = body.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents)):
        raise FieldError("documents: expected a list of objects of strings")
    extra: dict[str, object] = {"add_generation_prompt": generation, "continue_final_message": continue_final,
                                "documents": documents, "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in client:
        extra["enable_thinking"] = effort != "none"
    merged = {**client, **{k: v for k, v in extra.items() if v is not None}}
    defaults = {"tools": body["tools"]} if body.get("tools") is not None else {}
    return {**defaults, **{k: v for k, v in merged.items() if v is not None and v != "auto"}}


@functools.lru_cache(maxsize=8)  # the model directory's templates only: never a client's
def _template_variables(template: str) -> frozenset[str]:
    """The names a template reads from its context (what vLLM passes of chat_template_kwargs)."""
    import jinja2.ext
    import jinja2.meta
    import jinja2.nodes
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):  # transformers' {% generation %} tag, parsed as vLLM parses it
        tags = {"generation"}  # noqa: RUF012 jinja2's Extension declares tags a set, not a ClassVar

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[Generation, jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError as exc:
        raise PromptError("the model's chat template does not parse") from exc


def _size(value: object, budget: int) -> int:
    """Characters and items in a JSON value, counted up to just past ``budget`` (so a huge value costs little)."""
    stack, size = [value], 0
    while stack and size <= budget:
        item = stack.pop()
        size += 1
        if isinstance(item, str):
            size += len(item)
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) > _KWARGS_MAX_INT:
            return budget + 1
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif not (item is None or isinstance(item, (bool, int, float))):
            return budget + 1
    return size


def rust_encoder(tok: Any) -> Any | None:
    """``tok``'s Rust tokenizer, set up as ``tok(text)`` sets it up (no padding, no truncation; special tokens
    written in the text split as ``tok`` splits them, which transformers sets on it at load), where ``tok`` is
    transformers' plain fast tokenizer, whose call is that encode, and the two give the same tokens for each of
    :data:`_PROBES`; None for any other (a class that changes the call or its encoding, a transformers whose call
    does more): it is called, as vLLM calls it."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # transformers before 5: its own call
        return None
    kind = type(tok)
    if not isinstance(tok, TokenizersBackend) or kind.__call__ is not PreTrainedTokenizerBase.__call__ or \
            hasattr(tok, "_switch_to_input_mode") or any(getattr(kind, name) is not getattr(TokenizersBackend, name)
                                                         for name in _CALLED):
        return None
    backend: Any = tok._tokenizer
    if backend.padding is not None:
        backend.no_padding()
    if backend.truncation is not None:
        backend.no_truncation()
    for text in _PROBES:
        for special in (True, False):
            if backend.encode(text, add_special_tokens=special).ids != \
                    tok(text, add_special_tokens=special)["input_ids"]:
                return None
    return backend


def _cut(tokens: list[int], truncation: Truncation) -> list[int]:
    """``tokens`` truncated as vLLM truncates token ids (``TokenizeParams._token_truncation``)."""
    keep = truncation.keep
    if keep is None or keep < 0 or keep >= len(tokens):
        return tokens
    return tokens[:keep] if truncation.side == "right" else tokens[-keep:]


def _plain_text(part: object) -> bool:
    return (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            and part.keys() <= {"type", "text"})


def _text(content: object) -> object:
    """Message content as vLLM's default "string" content format gives it to the template: text parts joined
    (other parts are left out: the router's tokens of such a prompt are a count, not the engine's)."""
    if isinstance(content, list):
        return "\n".join(str(part["text"]) for part in content if _plain_text(part))
    return content


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _uncached(body: Mapping[str, object], chat: bool, truncation: Truncation) -> Uncached | None:
    messages = body.get("messages") if chat else None
    if isinstance(messages, list) and any(
            isinstance(m, Mapping) and isinstance(m.get("content"), list)
            and not all(_plain_text(part) for part in m["content"]) for m in messages):
        return Uncached.CONTENT_PARTS
    if truncation.keep == -1:
        return Uncached.TRUNCATED_TO_LIMIT
    # vLLM's to_sampling_params: echo asks for the prompt's logprobs (a chat's top_logprobs: 0 when unset or null)
    logprobs = body.get("prompt_logprobs")
    if logprobs is None and read_bool(body, "echo", False, nullable=True):
        logprobs = 0 if chat else body.get("logprobs")
    return Uncached.PROMPT_LOGPROBS if logprobs is not None else None


def read_prompt(tokenizer: Tokenizer, path: str, body: Mapping[str, object], base_models: set[str]) -> Prompt:
    """The prompt of a request body, as the engine will compute it. Raises :class:`PromptError` (and its
    :class:`FieldError`) where the router predicts nothing: the engine answers the request as it sees fit."""
    chat = path.endswith("/chat/completions")
    read_bool(body, "stream", False, nullable=True)  # a value vLLM refuses: nothing to predict
    truncation = read_truncation(body)
    tokens = tokenizer.chat(body) if chat else tokenizer.completion(body)
    model = body.get("model")
    lora = model if isinstance(model, str) and base_models and model not in base_models else None
    salt = body.get("cache_salt")
    for name, value in (("model", lora), ("cache_salt", salt)):
        if isinstance(value, str) and not _utf8(value):
            raise FieldError(f"{name}: not UTF-8 text (a lone surrogate): the router cannot key it")
    return Prompt(tokens=tokens, lora_name=lora, cache_salt=salt if isinstance(salt, str) and salt else None,
                  uncached=_uncached(body, chat, truncation))

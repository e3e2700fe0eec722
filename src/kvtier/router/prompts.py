"""A request's prompt as the engine will see it: token ids, LoRA name and cache salt.

The router tokenizes with the engines' own tokenizer and chat template (from their model directory), the way
vLLM's OpenAI server does: a completion's text with the tokenizer's special tokens, a chat rendered by the
template with the generation prompt and then tokenized without adding special tokens again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Prompt:
    tokens: Sequence[int]
    lora_name: str | None = None
    cache_salt: str | None = None


class PromptError(ValueError):
    """The body has no prompt the router can read; the request is routed without its cache."""


class Tokenizer:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer  # heavy: only the router needs it

        self._tok = AutoTokenizer.from_pretrained(model_dir)

    def completion(self, body: Mapping[str, object]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of prompts: route by the first
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                                            for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            add_special = body.get("add_special_tokens", True)
            return self._tok(prompt, add_special_tokens=bool(add_special))["input_ids"]
        raise PromptError("prompt: expected a string, a list of token ids, or a list of those")

    def chat(self, body: Mapping[str, object]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise PromptError("messages: expected a list of message objects")
        conversation = [{**m, "content": _text(m.get("content"))} for m in messages]
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise PromptError("chat_template_kwargs: expected an object")
        try:
            text = self._tok.apply_chat_template(
                conversation, tokenize=False, tools=body.get("tools"),
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)), **kwargs)
        except Exception as exc:  # a template's own error (jinja2 raises several kinds): not a routable prompt
            raise PromptError(f"the chat template failed: {exc}") from exc
        return self._tok(text, add_special_tokens=bool(body.get("add_special_tokens", False)))["input_ids"]


def _text(content: object) -> object:
    """Message content as vLLM's default "string" content format gives it to the template: text parts joined."""
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content
                         if isinstance(part, Mapping) and part.get("type") == "text")
    return content


def read_prompt(tokenizer: Tokenizer, path: str, body: Mapping[str, object], base_models: set[str]) -> Prompt:
    tokens = tokenizer.chat(body) if path.endswith("/chat/completions") else tokenizer.completion(body)
    model = body.get("model")
    lora = model if isinstance(model, str) and base_models and model not in base_models else None
    salt = body.get("cache_salt")
    return Prompt(tokens=tokens, lora_name=lora, cache_salt=salt if isinstance(salt, str) and salt else None)

"""Reading a request body as vLLM 0.32 reads it: its fields (pydantic's lax rules), the chat template (the model's
own, never the client's, with bounded kwargs), truncation and the fields that keep a prefix from being cached.
The model's real tokenizer (SmolLM2-135M), and a copy of it with a template of the tests' own."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from kvtier.bench.model import prepare_model
from kvtier.router.prompts import FieldError, Prompt, Tokenizer, Uncached, read_bool, read_int, read_prompt, \
    read_stream, rust_encoder, Truncation

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# A request template like the 223-byte one: 36 million iterations (1.3-1.8 s of the router's loop there),
# had the router rendered it.
LOOPS = ("{% for a in range(600) %}{% for b in range(600) %}{% for c in range(100) %}x{% endfor %}{% endfor %}"
         "{% endfor %}")
# A template of the tests' own: it reads one custom variable (``note``), documents and enable_thinking.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if note %}[{{ note }}]{% endif %}{% for d in documents or [] %}<doc>{{ d['text'] }}</doc>{% endfor %}"
            "{% if enable_thinking %}<think>{% endif %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return prepare_model()


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def custom(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The model's tokenizer with :data:`TEMPLATE`, adding a BOS token (``<|im_start|>``) as Llama's do."""
    target = tmp_path_factory.mktemp("tokenizer")
    shutil.copy(model_dir / "tokenizer_config.json", target)
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    bos = next(t["id"] for t in spec["added_tokens"] if t["content"] == "<|im_start|>")
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [bos], "tokens": ["<|im_start|>"]}}}
    (target / "tokenizer.json").write_text(json.dumps(spec))
    (target / "chat_template.jinja").write_text(TEMPLATE)
    tokenizer = Tokenizer(str(target))
    tokenizer.bos = bos  # type: ignore[attr-defined]
    tokenizer.dir = target  # type: ignore[attr-defined]
    return tokenizer


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every template source jinja2 compiles or parses while the test runs."""
    sources: list[str] = []
    for name in ("from_string", "parse"):
        original = getattr(jinja2.Environment, name)

        def spy(self, source, *args, _original=original, **kw):
            sources.append(str(source))
            return _original(self, source, *args, **kw)
        monkeypatch.setattr(jinja2.Environment, name, spy)
    return sources


def chat(tokenizer: Tokenizer, **fields) -> Prompt:
    return read_prompt(tokenizer, CHAT, {"model": "m", "messages": MESSAGES, **fields}, set())


def completion(tokenizer: Tokenizer, prompt, **fields) -> Prompt:
    return read_prompt(tokenizer, COMPLETION, {"model": "m", "prompt": prompt, **fields}, set())


# --- the chat template --------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["chat_template", "chat_template_kwargs"])
def test_a_template_in_the_request_is_never_compiled_nor_rendered(tok, compiled, where):
    body = {"chat_template": LOOPS} if where == "chat_template" else {"chat_template_kwargs": {"chat_template": LOOPS}}
    with pytest.raises(FieldError, match="^chat_template: a template in the request is not rendered"):
        chat(tok, **body)
    assert not any("range(600)" in source for source in compiled)


def test_the_models_own_template_renders_and_kwargs_it_does_not_read_are_not_passed(custom, compiled, monkeypatch):
    calls = []
    original = custom._tok.apply_chat_template
    monkeypatch.setattr(custom._tok, "apply_chat_template", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    plain = chat(custom).tokens
    assert chat(custom, chat_template_kwargs={"unread": "x" * 1_000_000}).tokens == plain
    assert all("unread" not in kw for kw in calls)
    assert all(kw["chat_template"] == TEMPLATE for kw in calls)  # the model directory's, named each time
    noted = chat(custom, chat_template_kwargs={"note": "be brief"}).tokens
    assert noted != plain and custom._tok.decode(noted).endswith("[be brief]<|im_start|>assistant\n")
    assert set(compiled) <= {TEMPLATE}


@pytest.mark.parametrize("value", ["x" * 1_000_000, ["x"] * 20_000, 10**9])
def test_a_large_kwarg_the_template_reads_is_not_rendered(custom, monkeypatch, value):
    """A value the template reads could be copied or looped over: past a small budget, no prediction (and no
    render: the 'x' * 1e8 of the issue added 350 MB)."""
    monkeypatch.setattr(custom._tok, "apply_chat_template", lambda *a, **kw: pytest.fail("rendered"))
    with pytest.raises(FieldError, match="^chat_template_kwargs: more than"):
        chat(custom, chat_template_kwargs={"note": value})


def test_kwargs_merge_as_vllm_merges_them(custom):
    """The request's own fields win over the client's kwargs; null and "auto" values are dropped; a reasoning
    effort turns thinking on unless the kwargs say."""
    assert chat(custom, chat_template_kwargs={"add_generation_prompt": False}).tokens == chat(custom).tokens
    assert chat(custom, chat_template_kwargs={"note": None}).tokens == chat(custom).tokens
    assert chat(custom, chat_template_kwargs={"note": "auto"}).tokens == chat(custom).tokens
    thinking = custom._tok.decode(chat(custom, reasoning_effort="low").tokens)
    assert thinking.endswith("<think><|im_start|>assistant\n")
    assert "<think>" not in custom._tok.decode(chat(custom, reasoning_effort="low",
                                                    chat_template_kwargs={"enable_thinking": False}).tokens)
    docs = custom._tok.decode(chat(custom, documents=[{"title": "t", "text": "Paris"}]).tokens)
    assert "<doc>Paris</doc>" in docs


# --- fields read as pydantic reads them -----------------------------------------------------------------------
BOOLS = [True, False, 0, 1, 0.0, 1.0, "true", "false", "False", "TRUE", "yes", "No", "on", "OFF", "t", "f", "y",
         "n", "1", "0", 2, -1, 0.5, "", " true", "true ", "2", "maybe", "ＴＲＵＥ", None, [], {}]


@pytest.mark.parametrize("value", BOOLS)
def test_booleans_read_as_pydantic_reads_them(value):
    pydantic = pytest.importorskip("pydantic")
    try:
        expected = pydantic.TypeAdapter(bool).validate_python(value)
    except pydantic.ValidationError:
        with pytest.raises(FieldError, match="^flag: expected a boolean"):
            read_bool({"flag": value}, "flag", True)
    else:
        assert read_bool({"flag": value}, "flag", not expected) is expected


@pytest.mark.parametrize("value", [5, -1, 5.0, True, "5", "-1", "+7", 5.5, "1e3", "0x5", "", [], -2, 2**63, "1" * 30])
def test_integers_read_as_pydantic_does_or_not_at_all(value):
    """Where the router reads an integer, it is the one pydantic reads; where pydantic would refuse, so does the
    router (a few strings pydantic takes, such as "1_000", the router refuses: it predicts nothing for them)."""
    pydantic = pytest.importorskip("pydantic")
    from typing import Annotated

    adapter = pydantic.TypeAdapter(Annotated[int, pydantic.Field(ge=-1, le=2**63 - 1)] | None)
    try:
        mine = read_int({"n": value}, "n", -1)
    except FieldError:
        mine = FieldError
    try:
        theirs = adapter.validate_python(value)
    except pydantic.ValidationError:
        theirs = FieldError
    assert mine == theirs


def test_a_string_false_is_false_for_every_flag(custom):
    assert read_stream({"stream": "false"}) is False and read_stream({"stream": "true"}) is True
    assert read_stream({"stream": None}) is False and read_stream({"stream": "sometimes"}) is False
    assert chat(custom, add_generation_prompt="false").tokens == chat(custom, add_generation_prompt=False).tokens
    assert chat(custom, add_generation_prompt="false").tokens != chat(custom).tokens
    assert completion(custom, "hello world", add_special_tokens="false").tokens == \
        completion(custom, "hello world", add_special_tokens=False).tokens


@pytest.mark.parametrize("fields, field", [
    ({"stream": "sometimes"}, "stream"),
    ({"add_generation_prompt": None}, "add_generation_prompt"),  # bool, not bool | None, in vLLM
    ({"continue_final_message": True}, "add_generation_prompt, continue_final_message"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncation_side": "middle"}, "truncation_side"),
    ({"documents": ["text"]}, "documents"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
])
def test_fields_vllm_refuses_give_no_prediction_and_name_the_field(tok, fields, field):
    with pytest.raises(FieldError) as info:
        chat(tok, **fields)
    assert str(info.value).startswith(field + ":")


# --- what the engine computes and caches ---------------------------------------------------------------------
def test_add_special_tokens_is_honoured_for_chats_and_completions(custom):
    bos = custom.bos
    assert completion(custom, "hello world").tokens[0] == bos  # completions add them by default
    assert completion(custom, "hello world", add_special_tokens=False).tokens[0] != bos
    default = chat(custom).tokens
    assert chat(custom, add_special_tokens=True).tokens == [bos, *default]  # chats do not, unless asked


def test_truncate_prompt_tokens_keeps_the_last_tokens_as_vllm_does(tok, custom):
    ids = list(range(100, 200))
    assert completion(tok, ids, truncate_prompt_tokens=10).tokens == ids[-10:]
    assert completion(tok, ids, truncate_prompt_tokens="10", truncation_side="right").tokens == ids[:10]
    assert completion(tok, ids, truncate_prompt_tokens=500).tokens == ids
    text = " ".join(f"word{i}" for i in range(50))
    full = completion(custom, text).tokens
    cut = completion(custom, text, truncate_prompt_tokens=10).tokens
    # the tokenizer truncates and keeps its BOS, as vLLM has it do
    assert len(cut) == 10 and cut[0] == custom.bos and cut[1:] == full[-9:]
    assert completion(custom, text, truncate_prompt_tokens=10, truncation_side="left").tokens == full[-10:]
    whole = chat(tok).tokens
    assert chat(tok, truncate_prompt_tokens=8).tokens == whole[-8:]


@pytest.mark.parametrize("path, fields, reason", [
    (CHAT, {"prompt_logprobs": 1}, Uncached.PROMPT_LOGPROBS),
    (CHAT, {"echo": True}, Uncached.PROMPT_LOGPROBS),  # vLLM takes top_logprobs (0) as prompt_logprobs
    (CHAT, {"echo": "true", "top_logprobs": None}, Uncached.PROMPT_LOGPROBS),  # null reads 0 there
    (COMPLETION, {"prompt_logprobs": 0}, Uncached.PROMPT_LOGPROBS),
    (COMPLETION, {"echo": True}, None),  # logprobs unset: no prompt logprobs
    (COMPLETION, {"echo": True, "logprobs": 2}, Uncached.PROMPT_LOGPROBS),
    (COMPLETION, {"truncate_prompt_tokens": -1}, Uncached.TRUNCATED_TO_LIMIT),
    (COMPLETION, {"truncate_prompt_tokens": 4}, None),
])
def test_fields_that_keep_vllm_from_reading_its_cache_predict_no_hit(tok, path, fields, reason):
    body = {"model": "m", "messages": MESSAGES, "prompt": "hello there world", **fields}
    prompt = read_prompt(tok, path, body, set())
    assert prompt.uncached is reason and prompt.tokens


def test_media_parts_predict_no_hit_and_count_the_text_alone(tok):
    text = {"type": "text", "text": "What is in this picture?"}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    alone = read_prompt(tok, CHAT, {"messages": [{"role": "user", "content": [text]}]}, set())
    assert alone.uncached is None
    mixed = read_prompt(tok, CHAT, {"messages": [{"role": "user", "content": [text, image]}]}, set())
    assert mixed.uncached is Uncached.CONTENT_PARTS and not mixed.uncached.stored
    assert mixed.tokens == alone.tokens



@pytest.mark.parametrize("fields", [{"cache_salt": "salt-\ud800"}, {"model": "adapter-\udc80"}])
def test_a_salt_or_adapter_name_that_is_not_utf8_text_gives_no_prediction(tok, fields):
    """JSON may escape a lone surrogate; keying it would fail (the router answered 500): no prediction instead."""
    with pytest.raises(FieldError, match="not UTF-8 text"):
        read_prompt(tok, COMPLETION, {"model": "m", "prompt": "hello", **fields}, {"m"})


def test_a_truncating_request_leaves_the_shared_tokenizer_as_it_was(tok):
    """A copy truncates: the tokenizer the threads share never does (set, its next call would unset it while
    another thread encodes with it: that prompt cut, or "Already borrowed")."""
    text = " ".join(f"word{i}" for i in range(50))
    whole = completion(tok, text).tokens
    assert completion(tok, text, truncate_prompt_tokens=10).tokens == whole[-10:]
    assert tok._tok._tokenizer.truncation is None
    elsewhere: list[list[int]] = []
    thread = threading.Thread(target=lambda: elsewhere.append(completion(tok, text, truncate_prompt_tokens=7).tokens))
    thread.start()
    thread.join()
    assert elsewhere == [whole[-7:]]
    assert tok._tok._tokenizer.truncation is None and tok._own._tokenizer.truncation is not None


def test_workers_truncating_at_once_share_a_few_copies_and_cut_each_prompt_as_asked(model_dir):
    """Sixteen threads truncating at once, each to its own length: every prompt cut as asked, and no more copies of
    the tokenizer made than it was given (one per thread would be 8 MiB each for SmolLM2's, a GiB for 64 workers
    with a large vocabulary)."""
    tok = Tokenizer(str(model_dir), cutters=2)  # its own: no copy made yet
    texts = [" ".join(f"w{t}x{i}" for i in range(60 + t)) for t in range(16)]
    wholes = [completion(tok, text).tokens for text in texts]
    start = threading.Barrier(16)
    wrong: list[object] = []  # (a failure in a thread does not fail the test by itself)

    def worker(t: int) -> None:
        start.wait()
        for _ in range(20):
            try:
                got = completion(tok, texts[t], truncate_prompt_tokens=5 + t).tokens
            except Exception as exc:  # noqa: BLE001 checked below (e.g. "Already borrowed": two threads in one copy)
                wrong.append(exc)
                return
            if got != wholes[t][-(5 + t):]:
                wrong.append((t, got))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
    assert 1 <= len(tok._spare) <= 2  # every copy made, all back in the pool


class _Taken:
    """A pool of copies whose every copy is in use, and that says so when waited on."""

    def __enter__(self) -> None:
        raise AssertionError("the thread that made the tokenizer (the event loop's) waited for a copy")

    def __exit__(self, *exc: object) -> None:
        pass


def test_the_event_loop_truncates_with_its_own_copy_while_the_workers_hold_theirs(model_dir):
    tok = Tokenizer(str(model_dir), cutters=1)
    text = " ".join(f"word{i}" for i in range(50))
    whole = completion(tok, text).tokens
    tok._cutters = _Taken()  # type: ignore[assignment]
    assert completion(tok, text, truncate_prompt_tokens=9).tokens == whole[-9:]
    outside: list[BaseException] = []
    thread = threading.Thread(target=lambda: _catch(outside, lambda: completion(tok, text, truncate_prompt_tokens=9)))
    thread.start()
    thread.join()
    assert [str(e) for e in outside] == ["the thread that made the tokenizer (the event loop's) waited for a copy"]


def _catch(into: list[BaseException], call) -> None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 checked in the test's thread
        into.append(exc)


def test_a_tokenizer_file_that_truncates_is_made_not_to_for_the_threads_sharing_it(model_dir, tmp_path):
    """A tokenizer.json may carry a truncation: the shared tokenizer's first call would unset it, which needs the
    tokenizer to itself while other threads encode with it. It is unset once, at load."""
    target = tmp_path
    shutil.copy(model_dir / "tokenizer_config.json", target)
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    (target / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer(str(target))
    assert tok._tok._tokenizer.truncation is None
    text = " ".join(f"word{i}" for i in range(50))
    assert len(completion(tok, text).tokens) > 4


# Texts where a tokenizer's call could differ from its backend's encode: empty, leading spaces, special tokens
# written in the text, multi-byte characters, a NUL, whitespace runs, a run of one character, a long text
TEXTS = ["", "Hello there", "  two leading spaces", "<|im_start|>user\nhi<|im_end|>\n", "naïve café 東京 🙂",
         "a\u0000b", "\n\n\t x  ", "=" * 300, " ".join(f"word{i}" for i in range(400))]


def as_vllm_loads(directory: Path):
    """The tokenizer as vLLM loads it, untouched by the router: what it calls to encode a prompt."""
    return AutoTokenizer.from_pretrained(str(directory), truncation_side="left")


def read_on(where: str, router: Tokenizer, body: dict) -> list[int]:
    """The tokens of ``body``'s prompt, read on the event loop's thread (the one that made ``router``) or on
    another (a worker's)."""
    if where == "loop":
        return read_prompt(router, COMPLETION, body, set()).tokens
    got: list[list[int]] = []
    thread = threading.Thread(target=lambda: got.append(read_prompt(router, COMPLETION, body, set()).tokens))
    thread.start()
    thread.join()
    return got[0]


@pytest.fixture(scope="module")
def in_rust(model_dir):
    """The tests asking for this are of the Rust encoder: transformers before 5 has none (its call is made); with
    a transformers that has one, the model's tokenizer must be encoded with it."""
    pytest.importorskip("transformers.tokenization_utils_tokenizers", reason="transformers before 5: no Rust encoder")
    assert rust_encoder(as_vllm_loads(model_dir)) is not None


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("where", ["loop", "worker"])
def test_the_rust_encoder_gives_the_tokens_transformers_call_gives(in_rust, tok, custom, model_dir, special,
                                                                   where):
    """The router encodes a plain fast tokenizer's text with its Rust backend, on the event loop's thread (encode)
    and on a worker's (encode_batch): the tokens are those of transformers' own call on the tokenizer vLLM loads,
    for the model's tokenizer and for one adding a BOS."""
    for router, directory in ((tok, model_dir), (custom, custom.dir)):
        assert router._rust is not None  # (the direct path is the one tested)
        vllm = as_vllm_loads(directory)
        for text in TEXTS:
            body = {"model": "m", "prompt": text, "add_special_tokens": special}
            assert read_on(where, router, body) == vllm(text, add_special_tokens=special)["input_ids"], text[:40]
    assert custom._encode("hi", True, Truncation(None, None))[0] == custom.bos


@pytest.fixture(scope="module")
def custom_as_vllm(custom):
    return as_vllm_loads(custom.dir)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=120), special=st.booleans())
def test_any_text_encodes_as_transformers_call_encodes_it(in_rust, custom, custom_as_vllm, text, special):
    assert custom._encode(text, special, Truncation(None, None)) == \
        custom_as_vllm(text, add_special_tokens=special)["input_ids"]


def test_a_tokenizer_file_that_pads_or_splits_special_tokens_is_encoded_as_its_call_encodes(in_rust, model_dir,
                                                                                          tmp_path):
    """A tokenizer.json may pad to a fixed length and a tokenizer_config.json split special tokens written in the
    text: transformers' call pads nothing and splits them; so does the Rust encoder set up at load."""
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    spec["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    router, vllm = Tokenizer(str(tmp_path)), as_vllm_loads(tmp_path)
    assert router._rust is not None
    text = "<|im_start|>user\nhi"
    tokens = completion(router, text).tokens
    assert tokens == vllm(text)["input_ids"]
    assert len(tokens) < 64 and vllm.convert_tokens_to_ids("<|im_start|>") not in tokens


def test_a_tokenizer_class_of_its_own_is_called_as_vllm_calls_it(model_dir, monkeypatch):
    """A tokenizer class that changes the call or its encoding (as some of transformers' model classes do) is not
    encoded with its backend: the router calls it, as vLLM does."""
    plain = as_vllm_loads(model_dir)
    extra = plain.convert_tokens_to_ids("<|im_end|>")

    class Own(type(plain)):  # type: ignore[misc]
        def _encode_plus(self, *args, **kwargs):
            encoded = super()._encode_plus(*args, **kwargs)
            encoded["input_ids"] = [*encoded["input_ids"], extra]
            return encoded

    class Called(type(plain)):  # type: ignore[misc]
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    class Strategies(type(plain)):  # type: ignore[misc]  # (how the call pads and truncates)
        def _get_padding_truncation_strategies(self, *args, **kwargs):
            return super()._get_padding_truncation_strategies(*args, **kwargs)

    for kind in (Own, Called, Strategies):
        other = as_vllm_loads(model_dir)
        other.__class__ = kind
        assert rust_encoder(other) is None
    own = as_vllm_loads(model_dir)
    own.__class__ = Own
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *args, **kwargs: own)
    router = Tokenizer(str(model_dir))
    assert router._rust is None
    assert completion(router, "Hello there").tokens == [*plain("Hello there")["input_ids"], extra]


def test_a_worker_encoding_a_long_prompt_leaves_the_event_loop_running(in_rust, tok):
    """A long prompt is tokenized on a worker thread so that the event loop serves on meanwhile: the worker's
    encode releases the GIL (held, the loop's thread would not run again until the encode ended)."""
    assert tok._rust is not None
    text = " ".join(f"word{i} is here" for i in range(40000))
    done, took = threading.Event(), []

    def work() -> None:
        start = time.perf_counter()
        completion(tok, text)
        took.append(time.perf_counter() - start)
        done.set()
    thread = threading.Thread(target=work)
    gaps, last = [], time.perf_counter()
    thread.start()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    thread.join()
    # Held, the loop's thread would run once or twice; released, it runs about every millisecond of the encode
    assert len(gaps) >= 10, f"the loop's thread ran {len(gaps)} times during an encode of {took[0]:.3f} s"


def test_a_tokenizer_whose_call_encodes_otherwise_than_its_backend_is_called(in_rust, model_dir):
    """Before the router encodes with a tokenizer's backend, the two are checked to agree at load: a call that
    gives other tokens (here an encoding changed on the tokenizer itself, its class being transformers' plain one)
    keeps the tokenizer called."""
    odd = as_vllm_loads(model_dir)
    plain = odd._encode_plus

    def more(*args, **kwargs):
        encoded = plain(*args, **kwargs)
        encoded["input_ids"] = [*encoded["input_ids"], 0]
        return encoded
    odd._encode_plus = more
    assert type(odd) is type(as_vllm_loads(model_dir))
    assert rust_encoder(odd) is None
    assert rust_encoder(as_vllm_loads(model_dir)) is not None

"""The proxy against hostile or odd traffic, both ways: engines behind vLLM's --api-key, an engine dying mid-event,
hop-by-hop headers, a compressed body, redirects, a session header that is not UTF-8, log forging through
prompt errors, and the admin listener. Scripted engines from test_proxy.py."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging

import aiohttp
import pytest
from aiohttp import web

from kvtier.errors import ConfigError
from kvtier.router.app import RouterApp
from kvtier.router.config import load_router_config
from kvtier.router.prompts import PromptError
from tests.router.test_proxy import ScriptedEngine, WordTokenizer, post, run, serve

KEY = "sk-engine-4f1c"


class KeyedEngine(ScriptedEngine):
    """vLLM started with --api-key: /v1/* refuses a request without the key; it records which of the router's own
    calls (/health, /v1/models, /metrics) came with it."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0
        self.own_calls: list[tuple[str, bool]] = []

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\n")

    @web.middleware
    async def guard(self, request: web.Request, handler):
        keyed = request.headers.get("Authorization") == f"Bearer {KEY}"
        if request.path != "/v1/completions":
            self.own_calls.append((request.path, keyed))
        if request.path == "/v1/models" and not keyed:
            self.refused += 1
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)


def test_the_routers_own_calls_carry_the_engines_key(monkeypatch):
    """With engine_api_key, health checks, /v1/models and scrapes are let in (base models learned: a LoRA request
    is keyed as one); a client's request is sent with the client's own Authorization only."""
    monkeypatch.setenv("KVTIER_TEST_ENGINE_KEY", KEY)

    async def main(url, engines, app):
        assert app.engines.base_models == {"m"}
        await app.engines.scrape("e0")
        assert {path for path, _ in engines[0].own_calls} == {"/health", "/v1/models", "/metrics"}
        assert all(keyed for _, keyed in engines[0].own_calls) and engines[0].refused == 0
        await post(url, "ok x")
        assert "Authorization" not in engines[0].headers[0]
    run(main, n=1, engine_class=KeyedEngine, engine_api_key="env:KVTIER_TEST_ENGINE_KEY")


def test_without_the_key_models_are_refused_and_the_log_says_why(caplog):
    async def main(url, engines, app):
        assert engines[0].refused == 1 and app.engines.base_models == set()
    with caplog.at_level(logging.WARNING, logger="kvtier.router.engines"):
        run(main, n=1, engine_class=KeyedEngine)
    assert "HTTP 401 (engines started with --api-key need engine_api_key)" in caplog.text


def test_the_key_file_must_be_private(tmp_path):
    path = tmp_path / "engine.key"
    path.write_text(KEY + "\n")
    config = {"tokenizer": "unused", "engines": [{"name": "e0", "url": "http://127.0.0.1:1"}],
              "engine_api_key": f"file:{path}"}
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="engine_api_key: .* mode 0600"):
        RouterApp(load_router_config(config), tokenizer=WordTokenizer())
    path.chmod(0o600)
    app = RouterApp(load_router_config(config), tokenizer=WordTokenizer())
    assert app.engines.own_headers == {"Authorization": f"Bearer {KEY}"}
    assert KEY not in repr(app.config)
    with pytest.raises(ConfigError, match="engine_api_key: expected 'file:") as err:
        load_router_config({**config, "engine_api_key": KEY})
    assert KEY not in str(err.value)


class DyingEngine(ScriptedEngine):
    """Streams one whole event and half of the next, then its connection goes."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        await reply.write(b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"te')
        await asyncio.sleep(0.2)
        request.transport.close()
        return reply


def test_an_engine_dying_mid_event_gives_whole_events_then_the_error():
    async def main(url, engines, app):
        status, _, body = await post(url, "ok x", stream=True)
        assert status == 200
        events = body.split(b"\n\n")
        assert events[-1] == b""
        parsed = [json.loads(e[len(b"data: "):]) for e in events[:-1]]  # each event whole, JSON
        assert parsed[0] == {"choices": [{"text": "a"}]}
        assert parsed[-1]["error"]["type"] == "upstream_error" and len(parsed) == 2
    run(main, n=1, engine_class=DyingEngine)


def test_events_split_across_chunks_pass_whole_and_byte_for_byte():
    class Splitting(ScriptedEngine):
        async def completions(self, request):
            await request.read()
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            for piece in (b"data: {\"a\"", b": 1}\n", b"\ndata: [DONE]\n\n"):
                await reply.write(piece)
                await asyncio.sleep(0.02)
            return reply

    async def main(url, engines, app):
        _, _, body = await post(url, "ok x", stream=True)
        assert body == b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    run(main, n=1, engine_class=Splitting)


async def raw_request(port: int, head: bytes, body: bytes = b"") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return answer


def test_headers_named_in_connection_expect_and_content_encoding_are_not_forwarded():
    """``Connection: X-Foo`` makes X-Foo hop-by-hop; Expect was the router's to answer; the body the engine gets
    is the inflated one, so it must not be labelled gzip (the engine would inflate it again)."""
    body = gzip.compress(json.dumps({"model": "m", "prompt": "ok x"}).encode())

    async def main(url, engines, app):
        answer = await raw_request(app.port(), b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Foo: 1\r\n"
                                   b"X-Bar: 2\r\nConnection: X-Foo\r\nContent-Encoding: gzip\r\n"
                                   b"Content-Type: application/json\r\n", body)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        sent = engines[0].headers[0]
        assert sent["X-Bar"] == "2" and "X-Foo" not in sent and "Content-Encoding" not in sent
        assert engines[0].requests[0]["prompt"] == "ok x"
        async with aiohttp.ClientSession() as session, session.post(
                url + "/v1/completions", json={"model": "m", "prompt": "ok y"}, expect100=True) as reply:
            assert reply.status == 200
        assert "Expect" not in engines[0].headers[-1]
    run(main, n=1)


def test_an_engine_redirect_is_not_followed():
    """A 307 would re-POST the prompt to another origin: the router treats it as the engine failing."""
    async def main(url, engines, app):
        elsewhere = ScriptedEngine()
        runner, elsewhere.url = await serve(elsewhere.app())
        try:
            engines[0].redirect = elsewhere.url + "/v1/completions"
            status, _, _ = await post(url, "ok x")
            assert status == 502 and not elsewhere.requests
        finally:
            await runner.cleanup()

    class Redirecting(ScriptedEngine):
        redirect = ""

        async def completions(self, request):
            self.requests.append(await request.json())
            raise web.HTTPTemporaryRedirect(self.redirect)
    run(main, n=1, engine_class=Redirecting)


def test_a_session_header_that_is_not_utf8_is_a_400_not_a_500():
    async def main(url, engines, app):
        body = json.dumps({"model": "m", "prompt": "ok x"}).encode()
        answer = await raw_request(app.port(), b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                   b"X-Session-ID: \xff\xfe\r\nContent-Type: application/json\r\n", body)
        assert answer.startswith(b"HTTP/1.1 400 ") and b"not UTF-8" in answer
        answer = await raw_request(app.port(), b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                   b"X-Session-ID: s1\r\nContent-Type: application/json\r\n", body)
        assert answer.startswith(b"HTTP/1.1 200 ")
        answer = await raw_request(app.port(), b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Foo: \xff\r\n")
        assert answer.startswith(b"HTTP/1.1 400 ")  # not every engine skipped as if unhealthy (a 503)
    run(main, policy="session")


def test_a_cache_salt_that_is_not_utf8_text_is_routed_without_a_prediction_not_a_500():
    """A lone surrogate (which JSON may escape) in cache_salt cannot be keyed: the request is routed unpredicted."""
    async def main(url, engines, app):
        body = json.dumps({"model": "m", "prompt": "ok " + " ".join(f"w{i}" for i in range(15)),
                           "cache_salt": "salt-\ud800"}).encode()
        async with aiohttp.ClientSession() as session, session.post(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as reply:
            assert reply.status == 200 and reply.headers["X-KVTier-Route-Reason"] == "unindexed"
        assert app.metrics.unpredicted.labels("unreadable")._value.get() == 1
    run(main, n=1, policy="cache_aware")


class QuotingTokenizer(WordTokenizer):
    """Fails as a chat template does, quoting the client's text in its message."""

    def completion(self, body):
        raise PromptError(f"the chat template failed: {body['prompt']}")


def test_prompt_errors_are_logged_once_escaped_and_counted(caplog):
    forged = "ok x\n2026-12-03 12:00:00 ERROR kvtier.store: tenant forgotten"

    async def main(url, engines, app):
        for _ in range(3):
            status, _, _ = await post(url, forged)
            assert status == 200  # routed without its cache
        assert app.metrics.unpredicted.labels("unreadable")._value.get() == 3
    with caplog.at_level(logging.INFO, logger="kvtier.router.app"):
        run(main, n=1, tokenizer=QuotingTokenizer())
    lines = [r.getMessage() for r in caplog.records if "routed without its cache" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "\\n2026-12-03" in lines[0]


def test_an_admin_listener_takes_metrics_and_the_index_detail_off_the_client_listener():
    async def main(url, engines, app):
        admin = f"http://127.0.0.1:{app.port('admin')}"
        await post(url, "ok x")
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/metrics") as reply:
                assert reply.status == 404
            async with session.get(url + "/health") as reply:
                assert reply.status == 200 and await reply.json() == {"status": "ok"}
            async with session.get(admin + "/metrics") as reply:
                assert reply.status == 200 and "kvtier_router_predicted_cached_tokens" in await reply.text()
            async with session.get(admin + "/health") as reply:
                assert set((await reply.json())["engines"]["e0"]) >= {"index_blocks", "places"}
            async with session.post(admin + "/v1/completions", json={"prompt": "ok"}) as reply:
                assert reply.status in (404, 405)  # the admin listener proxies nothing
    run(main, admin=True, explain_headers=False)


def test_without_explain_headers_no_answer_carries_the_prediction():
    """Headers and bodies a client gets: the engine's, plus X-Request-Id; nothing of the router's prediction."""
    async def main(url, engines, app):
        for stream in (False, True):
            status, headers, body = await post(url, "ok x", stream=stream)
            assert status == 200 and not any(h.lower().startswith("x-kvtier") for h in headers)
            assert b"predicted" not in body and b"kvtier" not in body
    run(main, admin=True, explain_headers=False)


def test_the_admin_listen_field_is_checked():
    with pytest.raises(ConfigError, match="admin_listen: expected host:port"):
        load_router_config({"tokenizer": "t", "engines": [{"name": "e0", "url": "http://h:1"}],
                            "admin_listen": "8001"})


def test_a_body_whose_gzip_is_broken_is_a_400():
    async def main(url, engines, app):
        body = gzip.compress(json.dumps({"model": "m", "prompt": "ok x"}).encode())
        answer = await raw_request(app.port(), b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                   b"Content-Encoding: gzip\r\nContent-Type: application/json\r\n",
                                   body[:10] + b"\x00" * 20 + body[30:])
        assert answer.startswith(b"HTTP/1.1 400 ") and b"cannot be read" in answer
        assert not engines[0].requests and app.metrics.refused.labels("bad_body")._value.get() == 1
    run(main, n=1)


def test_headers_an_engine_names_in_connection_are_not_passed_to_the_client():
    class Naming(ScriptedEngine):
        async def completions(self, request):
            await request.read()
            return web.json_response({"choices": []}, headers={"Connection": "X-Internal", "X-Internal": "10.0.0.7",
                                                               "X-Public": "1"})

    async def main(url, engines, app):
        status, headers, _ = await post(url, "ok x")
        assert status == 200 and headers["X-Public"] == "1" and "X-Internal" not in headers
    run(main, n=1, engine_class=Naming)


class CountingPattern:
    """wire.EVENT_END, counting the bytes it is made to scan."""

    def __init__(self, pattern) -> None:
        self.pattern, self.scanned, self.calls = pattern, 0, 0

    def finditer(self, data, pos: int = 0, *args):
        self.calls += 1
        self.scanned += len(data) - pos
        return self.pattern.finditer(data, pos, *args)


def test_a_long_event_in_many_chunks_is_scanned_once_not_per_chunk(monkeypatch):
    """An event of 256 KiB in 1 KiB writes: each byte is searched for an event's end about once (rescanning what
    is held at every chunk is quadratic: ~128x the bytes here), and the event passes whole."""
    import kvtier.router.wire as wire

    counting = CountingPattern(wire.EVENT_END)
    monkeypatch.setattr(wire, "EVENT_END", counting)
    payload = b"data: " + b"x" * 256 * 1024

    class Long(ScriptedEngine):
        async def completions(self, request):
            await request.read()
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            for i in range(0, len(payload), 1024):
                await reply.write(payload[i:i + 1024])
                await asyncio.sleep(0.001)
            await reply.write(b"\n\ndata: [DONE]\n\n")
            return reply

    async def main(url, engines, app):
        status, _, body = await post(url, "ok x", stream=True)
        assert status == 200 and body == payload + b"\n\ndata: [DONE]\n\n"
        assert counting.calls >= 16  # the event came in many chunks: the bound below means something
        assert counting.scanned <= len(body) + 4 * counting.calls
    run(main, n=1, engine_class=Long)


@pytest.mark.parametrize("pieces", [[b'data: {"a": 1}\n\r\ndata: {"te'],
                                    [b'data: {"a": 1}\n\r', b'\ndata: {"te'],
                                    [b'data: {"a": 1}\r', b'\n\r\ndata: {"te']])
def test_an_event_ended_by_mixed_line_endings_is_whole(pieces):
    """LF then CRLF is an event's end (a line end is CRLF, CR or LF): the event is passed on, then the error,
    with the end split across chunks too."""
    class Mixed(ScriptedEngine):
        async def completions(self, request):
            await request.read()
            reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await reply.prepare(request)
            for piece in pieces:
                await reply.write(piece)
                await asyncio.sleep(0.05)
            request.transport.close()
            return reply

    async def main(url, engines, app):
        status, _, body = await post(url, "ok x", stream=True)
        assert status == 200
        sent = b"".join(pieces)
        assert body.startswith(sent[:sent.index(b'data: {"te')] + b'data: {"error"')
    run(main, n=1, engine_class=Mixed)


STREAM = (b"data: a\n\r\ndata: b\r\nid: 2\r\n\r\ndata: c\r\rdata: d\n\ndata: e\r\n\n: note\r\n\r"
          b"data: f\n\rdata: g")
ENDS = {10, 28, 37, 46, 56, 65, 74}  # where STREAM's events end


def test_whole_events_are_cut_at_every_kind_of_end_wherever_the_chunks_split():
    from kvtier.router.wire import EventCutter

    assert {m.end() for m in __import__("re").finditer(rb"\n\r\n|\r\n\r\n|\r\r|\n\n|\r\n\n|\r\n\r(?!\n)|\n\r(?!\n)",
                                                          STREAM)} == ENDS  # the test's own reckoning
    for sizes in [(len(STREAM),), *((i, len(STREAM) - i) for i in range(1, len(STREAM))), (1,) * len(STREAM)]:
        cutter, at, passed, cuts = EventCutter(), 0, 0, []
        for size in sizes:
            passed += len(cutter.feed(STREAM[at:at + size]))
            at += size
            cuts.append(passed)
        assert set(cuts) - {0} <= ENDS, sizes  # cut at events' ends only
        assert passed == max(ENDS) and cutter.held == STREAM[max(ENDS):], sizes


def test_an_engine_url_with_credentials_fails_as_an_engine_not_as_a_500():
    """Refused in the config (engine_api_key is the way to authenticate); an engine URL with credentials that gets
    past it (built in code) is an upstream failure when a client sends its own Authorization: 502, not 500."""
    async def main(url, engines, app):
        status, _, body = await post(url, "ok x", headers={"Authorization": "Bearer client"})
        assert status == 502 and b"S3CRET" not in body
    import dataclasses

    async def scenario():
        engine = ScriptedEngine()
        runner, engine.url = await serve(engine.app())
        config = load_router_config({"tokenizer": "unused", "block_size": 4, "engines": [
            {"name": "e0", "url": engine.url}], "timeouts": {"first_byte_s": 5.0}, "retries": 0})
        secret = engine.url.replace("http://", "http://admin:S3CRET@")
        config = dataclasses.replace(config, engines=(dataclasses.replace(config.engines[0], url=secret),))
        app = RouterApp(config, tokenizer=WordTokenizer())
        listeners = await app.listen("127.0.0.1", 0)
        try:
            await main(f"http://127.0.0.1:{app.port()}", [engine], app)
        finally:
            for r in listeners:
                await r.cleanup()
            await runner.cleanup()
    asyncio.run(scenario())

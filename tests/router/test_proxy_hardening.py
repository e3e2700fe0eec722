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
        assert app.base_models == {"m"}
        await app._scrape("e0")
        assert {path for path, _ in engines[0].own_calls} == {"/health", "/v1/models", "/metrics"}
        assert all(keyed for _, keyed in engines[0].own_calls) and engines[0].refused == 0
        await post(url, "ok x")
        assert "Authorization" not in engines[0].headers[0]
    run(main, n=1, engine_class=KeyedEngine, engine_api_key="env:KVTIER_TEST_ENGINE_KEY")


def test_without_the_key_models_are_refused_and_the_log_says_why(caplog):
    async def main(url, engines, app):
        assert engines[0].refused == 1 and app.base_models == set()
    with caplog.at_level(logging.WARNING, logger="kvtier.router.app"):
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
    assert app._own_headers == {"Authorization": f"Bearer {KEY}"}
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
        status, _, body = await post(url, "ok x", stream=True)
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
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={"model": "m", "prompt": "ok y"},
                                    expect100=True) as reply:
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

"""Request fields through the proxy, with the model's real tokenizer, in front of a scripted engine (an aiohttp
server in this process) that answers as vLLM would: ``"stream": "false"`` gets a whole answer, which the router
must not time as a first byte; a request carrying its own chat template goes to the engine unrendered."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from kvtier.bench.model import prepare_model
from kvtier.metrics import sample_sum
from kvtier.router.app import RouterApp
from kvtier.router.config import load_router_config
from kvtier.router.prompts import Tokenizer

LOOPS = ("{% for a in range(600) %}{% for b in range(600) %}{% for c in range(100) %}x{% endfor %}{% endfor %}"
         "{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(prepare_model()))


class Engine:
    """Answers /v1/completions and /v1/chat/completions as vLLM's lax bool reads ``stream`` (whole answers take
    0.2 s: a generation), and refuses a request's own chat template with 400, as vLLM does by default."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.answer)
        app.router.add_post("/v1/chat/completions", self.answer)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if (body.get("chat_template_kwargs") or {}).get("chat_template") is not None:
            return web.json_response({"error": {"message": "Refused request with untrusted chat template."}},
                                     status=400)
        if str(body.get("stream")).lower() not in ("true", "1", "yes", "on"):
            await asyncio.sleep(0.2)
            return web.json_response({"choices": [{"text": "whole"}]})
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        await reply.write(b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
        return reply


def run(tokenizer: Tokenizer, scenario) -> None:
    async def main() -> None:
        engine = Engine()
        runners = []

        async def serve(app: web.Application) -> str:
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

        config = load_router_config({"tokenizer": "unused", "block_size": 4, "explain_headers": True,
                                     "engines": [{"name": "e0", "url": await serve(engine.app())}]})
        router = RouterApp(config, tokenizer=tokenizer)
        url = await serve(router.web_app())
        try:
            async with aiohttp.ClientSession() as session:
                await scenario(session, url, engine, router)
        finally:
            for r in reversed(runners):
                await r.cleanup()
    asyncio.run(main())


async def first_bytes_timed(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as reply:
        return sample_sum(await reply.text(), "kvtier_router_ttft_seconds_count")


def test_a_string_false_stream_is_a_whole_answer_not_timed_as_a_first_byte(tokenizer):
    async def scenario(session, url, engine, router):
        prompt = " ".join(f"word{i}" for i in range(40))
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": prompt,
                                                                "stream": "false"}) as reply:
            assert reply.status == 200 and json.loads(await reply.read())["choices"][0]["text"] == "whole"
        assert await first_bytes_timed(session, url) == 0  # a whole answer, read as vLLM reads "false"
        async with session.post(url + "/v1/completions", json={"model": "m", "prompt": prompt,
                                                                "stream": "true"}) as reply:
            assert reply.status == 200 and (await reply.read()).startswith(b"data: ")
        assert await first_bytes_timed(session, url) == 1  # a streamed answer's first byte is
    run(tokenizer, scenario)


def test_a_request_template_is_forwarded_unrendered_and_routed_without_a_prediction(tokenizer):
    async def scenario(session, url, engine, router):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"chat_template": LOOPS}}
        async with session.post(url + "/v1/chat/completions", json=body) as reply:
            assert reply.status == 400  # the engine's answer, passed through
            assert reply.headers["X-KVTier-Route-Reason"] == "unindexed"
        assert engine.bodies == [body]
    run(tokenizer, scenario)

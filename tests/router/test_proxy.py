"""The proxy's fault handling against scripted engines (aiohttp servers in this process): faults a real vLLM
server cannot produce on demand (a 5xx, a stall after the first byte, a connection cut mid-answer). The real
engine killed mid-stream is in test_fleet.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
import yaml
from aiohttp import web

from kvtier.router.app import RouterApp
from kvtier.router.config import load_router_config


class WordTokenizer:
    """One token per word: enough for routing decisions in these tests."""

    fast = True  # cheap enough to run on the event loop, as a fast tokenizer is

    def completion(self, body):
        return [hash(w) % 50000 for w in str(body.get("prompt", "")).split()]

    def chat(self, body):
        return [hash(w) % 50000 for m in body.get("messages", []) for w in str(m.get("content", "")).split()]


class ScriptedEngine:
    """/v1/completions acts on the prompt's first word: ok, fail500, stall, cut; it records aborted requests."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.aborted = 0
        self.headers: list[dict] = []
        self.url = ""
        self.broken = False  # answers every request with a 500

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(request.headers.copy())
        mode = body["prompt"].split()[0]
        if mode == "fail500" or (self.broken and mode != "hang"):
            return web.json_response({"error": "boom"}, status=500)
        if mode == "hang" and self.broken:
            await asyncio.sleep(3600)  # accepts the connection, never answers, not even its headers
        if mode == "bad400":
            return web.json_response({"error": {"message": "too long"}}, status=400)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "hello"}],
                                      "usage": {"prompt_tokens_details": {"cached_tokens": 0}}})
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        try:
            await reply.write(b'data: {"choices": [{"text": "a"}]}\n\n')
            if mode == "stall":
                await asyncio.sleep(3600)
            if mode == "cut":
                await asyncio.sleep(0.2)  # the first chunk reaches the router before the connection goes
                request.transport.close()
                return reply
            if mode == "slow":
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    await reply.write(b'data: {"choices": [{"text": "b"}]}\n\n')
            await reply.write(b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n')
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted += 1
            raise
        return reply


async def serve(app: web.Application, **kw) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, **kw)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def run(scenario: Callable[[str, list[ScriptedEngine], RouterApp], Awaitable[None]], n: int = 2,
        engine_class: type[ScriptedEngine] | None = None, tokenizer: object = None, admin: bool = False,
        fleet: int | None = None, on_uvloop: bool = False, **overrides) -> None:
    """``scenario(url, engines, app)`` against a router (listening as ``kvtier router`` does, with ``limits``)
    in front of ``n`` scripted engines (of class ``engine_class``), the first ``fleet`` of them (default all) in its
    config; ``admin``: with an admin listener; ``on_uvloop``: on uvloop's event loop, as ``kvtier router`` runs."""
    async def main() -> None:
        engines = [(engine_class or ScriptedEngine)() for _ in range(n)]
        runners = []
        for engine in engines:
            runner, engine.url = await serve(engine.app(), handler_cancellation=True)
            runners.append(runner)
        config = load_router_config({"tokenizer": "unused", "block_size": 4,
                                     "policy": "round_robin", "explain_headers": True,
                                     "engines": [{"name": f"e{i}", "url": e.url}
                                                 for i, e in enumerate(engines[:fleet])],
                                     "timeouts": {"idle_s": 1.0, "first_byte_s": 5.0}, **overrides})
        app = RouterApp(config, tokenizer=tokenizer or WordTokenizer())
        listeners = await app.listen("127.0.0.1", 0, ("127.0.0.1", 0) if admin else None)
        try:
            await scenario(f"http://127.0.0.1:{app.port()}", engines, app)
        finally:
            for r in reversed(listeners):
                await r.cleanup()
            for r in runners:
                await r.cleanup()
    if on_uvloop:
        uvloop = pytest.importorskip("uvloop")  # (the router extra installs it, but not on Windows)
        uvloop.run(main())
    else:
        asyncio.run(main())


async def post(url: str, prompt: str, stream: bool = False, **kw) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/completions", json={"model": "m", "prompt": prompt, "stream": stream}, **kw) as reply:
        return reply.status, reply.headers.copy(), await reply.read()


def test_a_5xx_before_the_first_byte_is_retried_on_another_engine():
    async def main(url, engines, app):
        engines[0].broken = True
        status, headers, body = await post(url, "ok x")  # round robin: e0 first, e1 takes the retry
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "hello"
        assert headers["X-KVTier-Engine"] == "e1"
        assert len(engines[0].requests) == 1 and len(engines[1].requests) == 1
    run(main)


def test_client_errors_pass_through_without_retry():
    async def main(url, engines, app):
        status, _, body = await post(url, "bad400 x")
        assert status == 400 and json.loads(body)["error"]["message"] == "too long"
        assert sum(len(e.requests) for e in engines) == 1
    run(main)


def test_all_engines_failing_gives_502_with_retry_after():
    async def main(url, engines, app):
        status, headers, body = await post(url, "fail500 x")
        assert status == 502 and headers["Retry-After"] == "1"
        assert json.loads(body)["error"]["type"] == "upstream_unavailable"
    run(main, retries=1)


@pytest.mark.parametrize("mode, cause", [("stall", "idle_timeout"), ("cut", "disconnected")])
def test_a_failure_after_the_first_byte_ends_the_stream_with_an_sse_error(mode, cause):
    async def main(url, engines, app):
        status, _headers, body = await post(url, f"{mode} x", stream=True)
        assert status == 200
        text = body.decode()
        assert text.startswith('data: {"choices": [{"text": "a"}]}')  # what came before passed through
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["type"] == "upstream_error" and cause in events[-1]["error"]["message"]
        assert "[DONE]" not in text
        assert sum(len(e.requests) for e in engines) == 1  # never retried after the first byte
    run(main)


def test_streams_pass_through_byte_for_byte_and_request_ids_are_forwarded():
    async def main(url, engines, app):
        _status, headers, body = await post(url, "ok x", stream=True, headers={"X-Request-Id": "req-7",
                                                                               "Authorization": "Bearer k"})
        assert body == b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'
        assert headers["X-Request-Id"] == "req-7"
        sent = engines[0].headers[0]
        assert sent["X-Request-Id"] == "req-7" and sent["Authorization"] == "Bearer k"
    run(main)


def test_a_client_that_leaves_aborts_the_upstream_request():
    async def main(url, engines, app):
        async with aiohttp.ClientSession() as session:
            reply = await session.post(url + "/v1/completions", json={"model": "m", "prompt": "slow x",
                                                                        "stream": True})
            await reply.content.readline()
            reply.close()  # the client goes away mid-stream
        for _ in range(100):
            if engines[0].aborted:
                break
            await asyncio.sleep(0.05)
        assert engines[0].aborted == 1
        assert not any(state.flights for state in app.router.engines.values())  # nothing left accounted
    run(main, n=1)


def test_bad_bodies_are_refused_with_400():
    async def main(url, engines, app):
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", data=b"{not json") as reply:
                assert reply.status == 400
            async with session.post(url + "/v1/completions", json=[1, 2]) as reply:
                assert reply.status == 400
        assert not any(e.requests for e in engines)
    run(main)


def test_no_healthy_engine_gives_503_and_health_says_so():
    async def main(url, engines, app):
        for state in app.router.engines.values():
            state.healthy = False
        status, headers, _ = await post(url, "ok x")
        assert status == 503 and headers["Retry-After"] == "1"
        async with aiohttp.ClientSession() as session, session.get(url + "/health") as reply:
            assert reply.status == 503
    run(main, health_interval_s=3600)


def test_an_engine_that_never_sends_its_headers_is_given_up_after_first_byte_s():
    async def main(url, engines, app):
        engines[0].broken = True
        status, headers, _body = await post(url, "hang x")
        assert status == 200 and headers["X-KVTier-Engine"] == "e1"
    run(main, timeouts={"first_byte_s": 0.5, "idle_s": 1.0})


def test_the_report_mode_that_would_corrupt_reference_counts_is_not_forwarded():
    async def main(url, engines, app):
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "prompt": "ok x", "vllm_xargs": {"kv_cache_report_mode": "full", "other": 1}}
            async with session.post(url + "/v1/completions", json=body) as reply:
                assert reply.status == 200
        assert engines[0].requests[0]["vllm_xargs"] == {"other": 1}
    run(main)


def test_routing_headers_only_when_asked_for():
    async def main(url, engines, app):
        status, headers, _ = await post(url, "ok x")
        assert status == 200 and headers["X-Request-Id"]
        assert not any(h.startswith("X-KVTier") for h in headers)
    run(main, explain_headers=False)


def test_traced_requests_carry_the_router_span_upstream_and_record_each_attempt():
    """With tracing on, the router continues the client's trace: a decision span (candidates, costs, reason), one
    upstream span per attempt (the failed one and its retry), and the engine is sent the attempt's own
    ``traceparent`` in place of the client's. With tracing off, the client's passes through as it came."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvtier import tracing

    client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def main(url, engines, app):
        engines[0].broken = True
        status, _, _ = await post(url, "ok x", headers={"traceparent": client})
        assert status == 200
        spans = {s.name: s for s in exporter.get_finished_spans()}
        attempts = [s for s in exporter.get_finished_spans() if s.name == "kvtier.router.upstream"]
        assert [a.attributes["engine"] for a in attempts] == ["e0", "e1"]
        assert [a.attributes["http.status_code"] for a in attempts[1:]] == [200]
        root, decision = spans["kvtier.router.request"], spans["kvtier.router.decision"]
        assert format(root.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
        assert root.parent.span_id == 0x00F067AA0BA902B7
        assert list(decision.attributes["candidates"]) == ["e0", "e1"]
        assert decision.attributes["reason"] == "round_robin" and decision.attributes["chosen"] == "e0"
        assert len(decision.attributes["predicted_ttft_s"]) == 2
        for engine, attempt in zip(engines, attempts):
            sent = engine.headers[-1]["traceparent"].split("-")
            assert sent[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
            assert sent[2] == format(attempt.context.span_id, "016x")  # the attempt's, not the client's

        tracing.use_provider(None)
        await post(url, "ok y", headers={"traceparent": client})
        assert engines[1].headers[-1]["traceparent"] == client

    tracing.use_provider(provider)
    try:
        run(main)
    finally:
        tracing.use_provider(None)


def test_first_bytes_count_against_the_ttft_objective_and_the_load_signals_are_exported():
    class LateEngine(ScriptedEngine):
        async def completions(self, request: web.Request) -> web.StreamResponse:
            if (await request.json())["prompt"].startswith("late"):
                await asyncio.sleep(2.0)  # its first byte past ttft_slo_s
            return await super().completions(request)

    async def scenario(url, engines, app):
        for prompt in ("ok one", "late two", "ok three"):
            assert (await post(url, prompt, stream=True))[0] == 200
        assert (await post(url, "ok whole"))[0] == 200  # a whole answer has no first byte: not counted
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as reply:
            text = await reply.text()
        slo = {outcome: float(value) for outcome, value in re.findall(
            r'^kvtier_router_ttft_slo_requests_total\{engine="e0",outcome="(\w+)"\} (\S+)$', text, re.M)}
        assert slo == {"met": 2, "missed": 1}
        for name in ("kvtier_router_queued_requests", "kvtier_router_queued_tokens",
                     "kvtier_router_in_flight_tokens", "kvtier_router_predicted_ttft_now_seconds"):
            assert f'{name}{{engine="e0"}}' in text, name

    run(scenario, n=1, engine_class=LateEngine, ttft_slo_s=1.0)  # (the others' met on a loaded machine too)


def test_engines_join_and_leave_with_the_config_file_while_serving(tmp_path):
    """The config file read again (as on SIGHUP, or when it changes): a new engine gets requests once it answered
    a health check; one removed gets none from then on and its series are gone; a bad file is refused and the
    running fleet kept."""
    from kvtier.router.app import ConfigFile

    async def scenario(url, engines, app):
        e0 = engines[0]
        path = tmp_path / "router.yaml"

        def write(names, **extra):
            path.write_text(yaml.safe_dump({
                "tokenizer": "unused", "block_size": 4, "policy": "round_robin", "explain_headers": True,
                "engines": [{"name": f"e{i}", "url": engines[i].url} for i in names],
                "timeouts": {"idle_s": 1.0, "first_byte_s": 5.0}, **extra}))

        async def served(n):
            return [(await post(url, f"ok {i}"))[1]["X-KVTier-Engine"] for i in range(n)]

        file = ConfigFile(app, path)
        assert set(await served(4)) == {"e0"}
        write([0, 1])
        await file.reload("test")
        assert set(await served(4)) == {"e0", "e1"}
        write([1])
        await file.reload("test")
        before = len(e0.requests)
        assert set(await served(4)) == {"e1"} and len(e0.requests) == before
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as reply:
            text = await reply.text()
        assert 'engine="e0"' not in text and 'kvtier_router_engine_healthy{engine="e1"} 1.0' in text
        assert "kvtier_router_engines 1.0" in text
        path.write_text("engines: [")  # not YAML
        await file.reload("test")
        write([0, 1], block_size=0)  # not a valid config
        await file.reload("test")
        assert set(await served(2)) == {"e1"}  # kept
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as reply:
            text = await reply.text()
        assert 'kvtier_router_config_reloads_total{outcome="refused"} 2.0' in text
        assert 'kvtier_router_config_reloads_total{outcome="applied"} 2.0' in text
        write([0, 1], retries=3)  # another setting with the engines: the engines now, the rest at a restart
        await file.reload("test")
        assert set(await served(4)) == {"e0", "e1"} and app.config.retries == 1
        assert app.engines.base_models == {"m"}
        write([2])  # a fleet that serves another model: its name is learned again (else read as a LoRA adapter's)
        await file.reload("test")
        assert set(await served(2)) == {"e2"} and app.engines.base_models == {"other"}

    made: list[ScriptedEngine] = []

    class ThirdServesAnother(ScriptedEngine):
        def __init__(self):
            super().__init__()
            made.append(self)

        async def models(self, request):
            return web.json_response({"data": [{"id": "other" if self is made[2] else "m"}]})

    run(scenario, n=3, fleet=1, engine_class=ThirdServesAnother)  # e1 and e2 are not in the fleet at first


def test_a_running_router_process_takes_its_engines_from_the_file_on_sighup(tmp_path):
    """`kvtier router` as a process, reload_s 0: SIGHUP applies the file's engines, a change alone does not;
    SIGTERM still stops it cleanly."""
    import signal
    import sys

    from kvtier.bench.model import prepare_model
    from kvtier.testing.servers import free_port

    port = free_port()
    path = tmp_path / "router.yaml"

    async def main():
        engines = [ScriptedEngine() for _ in range(2)]
        runners = []
        for engine in engines:
            runner, engine.url = await serve(engine.app(), handler_cancellation=True)
            runners.append(runner)

        def write(names):
            path.write_text(yaml.safe_dump({
                "listen": f"127.0.0.1:{port}", "tokenizer": str(prepare_model()), "block_size": 4,
                "policy": "round_robin", "explain_headers": True, "reload_s": 0,
                "engines": [{"name": f"e{i}", "url": engines[i].url} for i in names]}))

        async def served_by(want, within=30.0):
            deadline = time.monotonic() + within
            while True:
                seen = set()
                for i in range(4):
                    try:
                        status, headers, _ = await post(url, f"ok {i}")
                    except aiohttp.ClientError:
                        status = 0
                    if status == 200:
                        seen.add(headers["X-KVTier-Engine"])
                if seen == want:
                    return
                assert time.monotonic() < deadline, f"served by {seen}, expected {want}"
                await asyncio.sleep(0.2)

        write([0])
        url = f"http://127.0.0.1:{port}"
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvtier.cli", "router", "--config",
                                                    str(path), stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            await served_by({"e0"}, within=120)
            write([0, 1])
            proc.send_signal(signal.SIGHUP)
            await served_by({"e0", "e1"})
            write([1])
            await asyncio.sleep(1.0)
            await served_by({"e0", "e1"}, within=0)  # no signal (reload_s 0): not applied
            proc.send_signal(signal.SIGHUP)
            await served_by({"e1"})
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            for r in runners:
                await r.cleanup()
    asyncio.run(main())


def test_a_change_to_the_config_file_is_applied_within_reload_s(tmp_path):
    from kvtier.router.app import ConfigFile

    async def scenario(url, engines, app):
        path = tmp_path / "router.yaml"

        def write(names):
            path.write_text(yaml.safe_dump({
                "tokenizer": "unused", "block_size": 4, "policy": "round_robin", "explain_headers": True,
                "engines": [{"name": f"e{i}", "url": engines[i].url} for i in names]}))

        write([0, 1])
        watching = asyncio.get_running_loop().create_task(ConfigFile(app, path).watch())
        try:
            write([1])
            deadline = time.monotonic() + 10
            while "e0" in app.router.engines:
                assert time.monotonic() < deadline, "the change was never applied"
                await asyncio.sleep(0.05)
            assert {(await post(url, f"ok {i}"))[1]["X-KVTier-Engine"] for i in range(4)} == {"e1"}
        finally:
            watching.cancel()

    run(scenario, reload_s=0.1)


def test_a_new_engine_waits_for_its_replay_and_a_changed_weight_keeps_every_engine_routed():
    """An engine added with a replay endpoint that never answers is not routed to until its replay has ended
    (bounded by events.replay_s); a weight changed on every engine is changed in place: no engine leaves."""
    from kvtier.router.config import EngineConfig
    from kvtier.testing.servers import free_port

    async def scenario(url, engines, app):
        async def served(n=4):
            return {(await post(url, f"ok {i}"))[1]["X-KVTier-Engine"] for i in range(n)}

        e0 = app.config.engines[0]
        e1 = EngineConfig(name="e1", url=engines[1].url, kv_events=f"tcp://127.0.0.1:{free_port()}",
                          kv_events_replay=f"tcp://127.0.0.1:{free_port()}")  # nobody answers its replay
        joining = asyncio.get_running_loop().create_task(app.engines.update((e0, e1)))
        await asyncio.sleep(0.8)  # health checks of e1 ran meanwhile: it answers, but is not replayed
        assert "e1" in app.router.engines and "e1" not in app.router.healthy()
        assert await served() == {"e0"}
        assert await joining == (["e1"], [])
        assert await served() == {"e0", "e1"}
        heavier = tuple(dataclasses.replace(e, weight=2.0) for e in (e0, e1))
        changing = asyncio.get_running_loop().create_task(app.engines.update(heavier))
        assert await served() == {"e0", "e1"}  # while it is applied too
        assert await changing == ([], [])
        assert app.router.engines["e0"].weight == 2.0 and app.router.healthy() == ["e0", "e1"]

    run(scenario, fleet=1, events={"replay_s": 1.5}, health_interval_s=0.5)

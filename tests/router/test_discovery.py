"""Engines found while serving: DNS records from a real DNS server (dnslib) on loopback, and EndpointSlices through
the official kubernetes client from kvtier.testing.kube_api's API server. The engines are scripted vLLM API
servers, each on its own loopback address and one shared port, as pods behind a headless Service are."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from dnslib import AAAA, QTYPE, RCODE, RR, A
from kubernetes.client import ApiClient
from dnslib.server import BaseResolver, DNSLogger, DNSServer

from kvtier.errors import ConfigError
from kvtier.router.app import RouterApp
from kvtier.router.config import DiscoveryConfig, load_router_config
from kvtier.router.sources import engine_name
from kvtier.router.discovery_k8s import KubernetesSource
from kvtier.router.metrics import LogOnce
from kvtier.testing.kube_api import KubeAPI, endpoint_slice
from kvtier.testing.servers import free_port
from tests.router.test_events import seq_bytes, stored_payload
from tests.router.test_proxy import ScriptedEngine, WordTokenizer, post

NAME = "vllm.kvtier.svc.cluster.local"


class Records(BaseResolver):
    """A name's A and AAAA records, changed by the test; ``stalled``: no answer at all; ``failing``: SERVFAIL."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.stalled = False
        self.failing = False
        self.asked = 0

    def resolve(self, request, handler):
        self.asked += 1
        reply = request.reply()
        if self.stalled:
            time.sleep(2)  # (past the resolver's lifetime: its answer comes too late)
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        qname, qtype = request.q.qname, QTYPE[request.q.qtype]
        if self.failing:
            reply.header.rcode = RCODE.SERVFAIL
        elif str(qname).rstrip(".") != NAME or not self.addresses:
            reply.header.rcode = RCODE.NXDOMAIN
        else:
            for address in self.addresses:
                if (":" in address) == (qtype == "AAAA"):
                    rdata = AAAA(address) if ":" in address else A(address)
                    reply.add_answer(RR(qname, QTYPE.AAAA if ":" in address else QTYPE.A, rdata=rdata, ttl=1))
        return reply


@pytest.fixture()
def dns_server():
    records = Records()
    server = DNSServer(records, address="127.0.0.1", port=0, logger=DNSLogger("-request,-reply,-truncated,-data"))
    server.start_thread()
    yield records, f"127.0.0.1:{server.server.server_address[1]}"
    server.stop()


@contextlib.asynccontextmanager
async def engines_at(addresses: list[str]) -> AsyncIterator[int]:
    """Scripted engines, one per loopback address, all on one port (yielded), stopped at the end."""
    probe = socket.socket()
    probe.bind((addresses[0], 0))
    port = probe.getsockname()[1]
    probe.close()
    runners = []
    try:
        for address in addresses:
            runner = web.AppRunner(ScriptedEngine().app())
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, address, port).start()
        yield port
    finally:
        for runner in runners:
            await runner.cleanup()


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.05)


def router(discovery: list[dict], **overrides) -> RouterApp:
    config = load_router_config({"tokenizer": "unused", "block_size": 4, "policy": "round_robin",
                                 "explain_headers": True, "health_interval_s": 0.5, "discovery": discovery,
                                 **overrides})
    return RouterApp(config, tokenizer=WordTokenizer())


async def serving(app: RouterApp, scenario) -> None:
    listeners = await app.listen("127.0.0.1", 0)
    try:
        await scenario(f"http://127.0.0.1:{app.port()}")
    finally:
        for r in reversed(listeners):
            await r.cleanup()


async def served_by(url: str, n: int) -> set[str]:
    """The engines that answered ``n`` requests."""
    names = set()
    for _ in range(n):
        status, headers, _ = await post(url, "ok x")
        assert status == 200
        names.add(headers["X-KVTier-Engine"])
    return names


def test_engines_come_and_go_with_the_dns_records_and_a_dns_failure_keeps_them(dns_server):
    records, nameserver = dns_server
    records.addresses = ["127.0.0.2"]

    async def main():
        async with engines_at(["127.0.0.2", "127.0.0.3", "127.0.0.4"]) as port:
            app = router([{"source": "dns", "name": NAME, "port": port, "interval_s": 0.2, "nameserver": nameserver}])
            e2, e3, e4 = (engine_name("vllm", f"127.0.0.{i}") for i in (2, 3, 4))
            assert e2 == "vllm-127-0-0-2"

            async def scenario(url):
                # the first answer is in the fleet before the router listens
                assert set(app.router.engines) == {e2} and await served_by(url, 2) == {e2}
                records.addresses = ["127.0.0.2", "127.0.0.3"]
                await until(lambda: set(app.router.healthy()) == {e2, e3})
                assert await served_by(url, 4) == {e2, e3}
                records.addresses = ["127.0.0.3", "127.0.0.4"]  # one pod replaced by another
                await until(lambda: set(app.router.engines) == {e3, e4} and len(app.router.healthy()) == 2)
                assert await served_by(url, 4) == {e3, e4}
                metrics = app.metrics.registry.get_sample_value
                # the DNS server fails, then gives no answer at all: the engines found are kept
                for fault in ("failing", "stalled"):
                    before = metrics("kvtier_router_discovery_errors_total", {"kind": "dns"}) or 0
                    setattr(records, fault, True)
                    await until(lambda seen=before: (
                        metrics("kvtier_router_discovery_errors_total", {"kind": "dns"}) or 0) > seen)
                    assert set(app.router.engines) == {e3, e4} and await served_by(url, 2) == {e3, e4}
                    setattr(records, fault, False)
                assert metrics("kvtier_router_discovered_engines", {"source": "discovery[0]"}) == 2
                records.addresses = []  # the Service scaled to nothing: NXDOMAIN is an answer
                await until(lambda: not app.router.engines)
                status, _, _ = await post(url, "ok x")
                assert status == 503

            await serving(app, scenario)

    asyncio.run(main())


def test_the_config_files_engines_and_the_discovered_ones_are_one_fleet_and_a_name_is_never_taken_twice(dns_server):
    records, nameserver = dns_server
    records.addresses = ["127.0.0.2", "127.0.0.3"]

    async def main():
        async with engines_at(["127.0.0.2", "127.0.0.3"]) as port:
            # the file names the second address's engine already (under the name discovery would give it)
            app = router([{"source": "dns", "name": NAME, "port": port, "interval_s": 0.2, "nameserver": nameserver}],
                         engines=[{"name": "vllm-127-0-0-3", "url": f"http://127.0.0.3:{port}", "weight": 2}])

            async def scenario(url):
                assert set(app.router.engines) == {"vllm-127-0-0-2", "vllm-127-0-0-3"}
                assert app.router.engines["vllm-127-0-0-3"].weight == 2  # the file's, not the source's
                assert app.metrics.registry.get_sample_value("kvtier_router_discovery_errors_total",
                                                             {"kind": "name"}) == 1

            await serving(app, scenario)

    asyncio.run(main())


# --- Kubernetes ----------------------------------------------------------------------------------------------
PORTS = {"http": 0, "kv-events": 5557}


@pytest.fixture()
def kube(tmp_path):
    api = KubeAPI().start()
    yield api, api.kubeconfig(tmp_path / "kubeconfig", namespace="kvtier")
    api.stop()


def slice_of(port: int, endpoints, name: str = "vllm-abc12") -> dict:
    return endpoint_slice(name, "vllm", {"http": port, "kv-events": 5557}, endpoints, namespace="kvtier")


def test_engines_follow_a_services_ready_endpoints_through_the_kubernetes_api(kube):
    api, kubeconfig = kube

    async def main():
        async with engines_at(["127.0.0.2", "127.0.0.3", "127.0.0.4"]) as port:
            api.apply(slice_of(port, [("127.0.0.2", "vllm-0", True), ("127.0.0.3", "vllm-1", False)]))
            api.apply(endpoint_slice("other-x", "other", {"http": port}, [("127.0.0.4", "other-0", True)],
                                     namespace="kvtier"))  # another Service's: never an engine
            app = router([{"source": "kubernetes", "service": "vllm", "port": "http", "kubeconfig": str(kubeconfig),
                           "interval_s": 0.2}])

            async def scenario(url):
                assert set(app.router.engines) == {"vllm-0"}  # the ready endpoint alone, by its pod's name
                assert await served_by(url, 2) == {"vllm-0"}
                api.apply(slice_of(port, [("127.0.0.2", "vllm-0", True), ("127.0.0.3", "vllm-1", None)]))
                await until(lambda: set(app.router.healthy()) == {"vllm-0", "vllm-1"})  # (no condition: ready)
                assert await served_by(url, 4) == {"vllm-0", "vllm-1"}
                # a second slice of the Service, while the API forgot its history and dropped the watch: the router
                # lists again (the watch's 410) and follows it
                api.compact()
                api.drop()
                api.apply(slice_of(port, [("127.0.0.4", "vllm-2", True)], name="vllm-def34"))
                await until(lambda: set(app.router.healthy()) == {"vllm-0", "vllm-1", "vllm-2"})
                # the API is down: the engines found are kept; what changed meanwhile is followed once it is back
                api.failing = True
                api.drop()
                metrics = app.metrics.registry.get_sample_value
                await until(lambda: (metrics("kvtier_router_discovery_errors_total", {"kind": "kubernetes"}) or 0) > 0)
                api.delete("vllm-abc12", namespace="kvtier")
                await asyncio.sleep(0.5)
                assert set(app.router.engines) == {"vllm-0", "vllm-1", "vllm-2"}
                assert await served_by(url, 3) == {"vllm-0", "vllm-1", "vllm-2"}
                api.failing = False
                await until(lambda: set(app.router.engines) == {"vllm-2"})
                assert await served_by(url, 2) == {"vllm-2"}

            await serving(app, scenario)

    asyncio.run(main())


def test_a_wrong_token_is_counted_and_finds_no_engine(kube, tmp_path):
    api, kubeconfig = kube
    api.apply(slice_of(8000, [("127.0.0.2", "vllm-0", True)]))
    api.token = "rotated"

    async def main():
        app = router([{"source": "kubernetes", "service": "vllm", "kubeconfig": str(kubeconfig), "interval_s": 0.2}])

        async def scenario(url):
            assert not app.router.engines
            assert app.metrics.registry.get_sample_value("kvtier_router_discovery_errors_total",
                                                         {"kind": "kubernetes"}) >= 1

        await serving(app, scenario)

    asyncio.run(main())


def reader(**settings) -> KubernetesSource:
    """A Kubernetes source that only reads slices (no API client)."""
    config = DiscoveryConfig(source="kubernetes", service="vllm", **settings)

    class Reader(KubernetesSource):
        def __init__(self):
            self.config, self.field = config, "discovery[0]"
            self._errors = LogOnce(None, "kvtier_router_discovery_errors", logging.getLogger(__name__))

    return Reader()


def parsed(obj):  # as the client reads the API's answer
    return ApiClient().deserialize(json.dumps(obj), "V1EndpointSlice", "application/json")


def test_endpoint_slices_become_engines_with_their_named_ports():
    source = reader(port="http", kv_events_port="kv-events", kv_events_replay_port=5558, role="decode", weight=2.0)
    slices = [parsed(endpoint_slice("a", "vllm", {"http": 8000, "kv-events": 5557},
                                    [("10.1.0.5", "vllm-0", True), ("10.1.0.7", None, None),
                                     ("10.1.0.6", "vllm-1", False), ("10.1.0.9", "vllm-2", True)],
                                    terminating=frozenset({"vllm-2"}))),
              parsed(endpoint_slice("b", "vllm", {"metrics": 9000}, [("10.1.0.8", "vllm-3", True)]))]
    found = {e.name: e for e in source.engines_of(slices)}
    # not ready (vllm-1), terminating (vllm-2), or in a slice without port http (vllm-3): not engines
    assert set(found) == {"vllm-0", "vllm-10-1-0-7"}
    assert found["vllm-0"].url == "http://10.1.0.5:8000"
    assert found["vllm-0"].kv_events == "tcp://10.1.0.5:5557"
    assert found["vllm-0"].kv_events_replay == "tcp://10.1.0.5:5558"
    assert found["vllm-0"].role == "decode" and found["vllm-0"].weight == 2.0


def test_a_dual_stack_services_pods_are_each_one_engine_and_hostile_pod_names_never_name_one():
    v4 = parsed(endpoint_slice("v4", "vllm", {"http": 8000}, [("10.1.0.5", "vllm-0", True),
                                                              ("10.1.0.6", "x" * 100, True),
                                                              ("10.1.0.7", "evil\r\nSet-Cookie: a", True)]))
    v6 = parsed(endpoint_slice("v6", "vllm", {"http": 8000}, [("fd00::5", "vllm-0", True)], address_type="IPv6"))
    assert {e.name for e in reader(port="http").engines_of([v6, v4])} == {"vllm-0", "vllm-10-1-0-6",
                                                                          "vllm-10-1-0-7"}
    assert {e.url for e in reader(port="http").engines_of([v6, v4])} == {
        "http://10.1.0.5:8000", "http://10.1.0.6:8000", "http://10.1.0.7:8000"}  # prefer_ipv4, in any order
    only6 = {e.name: e for e in reader(port="http", address_family="ipv6").engines_of([v4, v6])}
    assert list(only6) == ["vllm-0"] and only6["vllm-0"].url == "http://[fd00::5]:8000"
    assert reader(port="http").engines_of([v6])[0].url == "http://[fd00::5]:8000"  # no IPv4 slice: IPv6


@pytest.mark.parametrize("entry, message", [
    ({"source": "dns"}, "discovery[0].name: required for source dns"),
    ({"source": "dns", "name": NAME, "service": "x"}, "discovery[0].service: not a setting of source dns"),
    ({"source": "dns", "name": NAME, "port": "http"}, "discovery[0].port: expected a port number"),
    ({"source": "kubernetes", "service": "Vllm"}, "discovery[0].service: expected a Kubernetes name"),
    ({"source": "kubernetes", "service": "v", "kv_events_replay_port": 5558},
     "discovery[0].kv_events_replay_port: set only with kv_events_port"),
    ({"source": "consul", "name": NAME}, "discovery[0].source: expected one of 'dns', 'kubernetes'"),
    ({"source": "dns", "name": NAME, "nameserver": "10.0.0.1"}, "discovery[0].nameserver: expected IP:port"),
    ({"source": "dns", "name": NAME, "nameserver": "kube-dns:53"}, "discovery[0].nameserver: expected IP:port"),
    ({"source": "dns", "name": "vllm"}, "discovery[0].name: expected a fully qualified DNS name"),
    ({"source": "dns", "name": NAME, "max_engines": 0}, "discovery[0].max_engines: must be in"),
    ({"source": "dns", "name": NAME, "address_family": "ipx"}, "discovery[0].address_family: expected one of"),
    ({"source": "dns", "name": NAME, "role": "prefill"}, "engines: every engine has role prefill"),
])
def test_bad_discovery_entries_are_refused_naming_the_field(entry, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_router_config({"tokenizer": "unused", "discovery": [entry]})


def test_a_kubeconfig_that_cannot_be_used_is_a_config_error(tmp_path):
    bad = tmp_path / "kubeconfig"
    bad.write_text("clusters: []\n")
    with pytest.raises(ConfigError, match=r"discovery\[0\]\.kubeconfig: .* is not a usable kubeconfig"):
        router([{"source": "kubernetes", "service": "vllm", "kubeconfig": str(bad)}])
    with pytest.raises(ConfigError, match=r"discovery\[0\]: not in a Kubernetes pod"):
        router([{"source": "kubernetes", "service": "vllm"}])


def test_a_discovered_engines_kv_events_are_followed_and_it_is_routed_to_once_its_replay_ended(dns_server):
    """Its events at ADDRESS:kv_events_port reach the index under its name; one whose replay port never answers
    is not routed to before events.replay_s has passed."""
    records, nameserver = dns_server
    records.addresses = ["127.0.0.2"]

    async def main():
        async with engines_at(["127.0.0.2", "127.0.0.3"]) as port:
            events_port = free_port()
            ctx = zmq.asyncio.Context()
            pub = ctx.socket(zmq.PUB)
            pub.bind(f"tcp://127.0.0.3:{events_port}")  # the second engine's publisher (nobody at its replay port)
            app = router([{"source": "dns", "name": NAME, "port": port, "kv_events_port": events_port,
                           "kv_events_replay_port": free_port(), "interval_s": 0.2, "nameserver": nameserver}],
                         events={"replay_s": 2.0})
            e2, e3 = "vllm-127-0-0-2", "vllm-127-0-0-3"

            async def scenario(url):
                records.addresses = ["127.0.0.2", "127.0.0.3"]
                await until(lambda: e3 in app.router.engines)
                joined = time.monotonic()
                assert e3 not in app.router.healthy() and await served_by(url, 2) == {e2}
                await until(lambda: e3 in app.router.healthy())
                assert time.monotonic() - joined > 1.0  # (its replay's bound, less the time to see it join)
                for seq in range(1, 40):  # (a SUB connects a while after it is made: sent until it arrives)
                    await pub.send_multipart([b"kv", seq_bytes(seq), stored_payload(seq, 3)])
                    if app.index.blocks(e3):
                        break
                    await asyncio.sleep(0.1)
                assert app.index.blocks(e3) >= 3 and app.index.blocks(e2) == 0

            try:
                await serving(app, scenario)
            finally:
                pub.close(linger=0)
                ctx.term()

    asyncio.run(main())


def test_dns_answers_dual_stack_once_within_max_engines_and_one_empty_answer_keeps_the_fleet(dns_server):
    """A and AAAA records of the same pods: the IPv4 ones are the engines; more than max_engines: the first by
    name; an engine at an address the file has already: left out; one empty answer (a DNS server restarting)
    keeps the engines, two in a row are the fleet."""
    records, nameserver = dns_server

    async def main():
        async with engines_at([f"127.0.0.{i}" for i in range(2, 7)]) as port:
            records.addresses = [f"127.0.0.{i}" for i in range(2, 7)] + ["::1"]
            app = router([{"source": "dns", "name": NAME, "port": port, "interval_s": 0.3, "nameserver": nameserver,
                           "max_engines": 3}],
                         engines=[{"name": "e-file", "url": f"http://127.0.0.4:{port}"}])
            metrics = app.metrics.registry.get_sample_value

            async def scenario(url):
                assert set(app.router.engines) == {"e-file", "vllm-127-0-0-2", "vllm-127-0-0-3"}  # .4: the file's
                assert metrics("kvtier_router_discovery_errors_total", {"kind": "max_engines"}) >= 1
                assert metrics("kvtier_router_discovery_errors_total", {"kind": "address"}) == 1
                records.addresses = []
                asked = records.asked
                await until(lambda: records.asked >= asked + 2)  # one answer: empty
                assert "vllm-127-0-0-2" in app.router.engines
                await until(lambda: set(app.router.engines) == {"e-file"})  # the next one: empty too

            await serving(app, scenario)

    asyncio.run(main())


@pytest.mark.parametrize("fault", ["cut_watches", "expire_watches"])
def test_an_api_that_ends_or_expires_every_watch_is_asked_again_after_growing_waits(kube, fault):
    api, kubeconfig = kube
    api.apply(slice_of(8000, [("127.0.0.2", "vllm-0", True)]))

    async def main():
        app = router([{"source": "kubernetes", "service": "vllm", "kubeconfig": str(kubeconfig),
                       "interval_s": 2.0}])

        async def scenario(url):
            setattr(api, fault, True)
            api.drop()
            before = api.requests
            await asyncio.sleep(3.0)
            # waits of 0.2, 0.4, 0.8, 1.6 s: a handful of requests, not hundreds
            assert api.requests - before <= 12, api.requests - before
            kind = "watch_ended" if fault == "cut_watches" else "expired"
            assert app.metrics.registry.get_sample_value("kvtier_router_discovery_errors_total",
                                                         {"kind": kind}) >= 2
            assert set(app.router.engines) == {"vllm-0"}

        await serving(app, scenario)

    asyncio.run(main())


def test_a_fleet_that_could_not_be_applied_is_applied_again(dns_server, monkeypatch):
    records, nameserver = dns_server
    records.addresses = ["127.0.0.2"]

    async def main():
        async with engines_at(["127.0.0.2", "127.0.0.3"]) as port:
            app = router([{"source": "dns", "name": NAME, "port": port, "interval_s": 0.2, "nameserver": nameserver}])
            update = app.engines.update
            failures = []

            async def failing_once(engines):
                if not failures and len(engines) == 2:
                    failures.append(1)
                    raise RuntimeError("injected")
                return await update(engines)

            monkeypatch.setattr(app.engines, "update", failing_once)

            async def scenario(url):
                records.addresses = ["127.0.0.2", "127.0.0.3"]
                await until(lambda: failures)
                await until(lambda: len(app.router.engines) == 2)  # the sources report no change: retried alone
                assert app.metrics.registry.get_sample_value("kvtier_router_discovery_errors_total",
                                                             {"kind": "apply"}) == 1

            await serving(app, scenario)

    asyncio.run(main())

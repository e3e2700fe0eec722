"""A Kubernetes API server of EndpointSlices alone, on loopback, for the router's discovery tests.

No kube-apiserver can run on these machines (no Go toolchain or images), so this one speaks the part of its HTTP
API that a client of EndpointSlices uses, as the API defines it: ``GET /apis/discovery.k8s.io/v1/namespaces/NS/
endpointslices`` lists (with ``labelSelector``, equality terms) or, with ``watch=1``, streams events
(``ADDED``/``MODIFIED``/``DELETED``, ``BOOKMARK`` when asked for, one JSON object a line) from ``resourceVersion``
until ``timeoutSeconds``; a version older than what it keeps is answered with an ``ERROR`` event of status 410
(Expired), as an API server answers after etcd compacted it; a request without the bearer token gets 401. The
official ``kubernetes`` client talks to it through :meth:`KubeAPI.kubeconfig`.

The test drives it: :meth:`KubeAPI.apply` and :meth:`KubeAPI.delete` change slices, :meth:`KubeAPI.compact`
forgets the history, :meth:`KubeAPI.drop` ends the watches under way, and :attr:`KubeAPI.failing` answers every
request with 503 (an API server down behind its load balancer).
"""

from __future__ import annotations

import copy
import functools
import json
import secrets
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_PATH = "/apis/discovery.k8s.io/v1/namespaces/"


def endpoint_slice(name: str, service: str, ports: dict[str, int],
                   endpoints: list[tuple[str, str | None, bool | None]], namespace: str = "default",
                   address_type: str = "IPv4", terminating: frozenset[str] = frozenset()) -> dict[str, Any]:
    """An EndpointSlice of ``service``: ``ports`` by name, ``endpoints`` as (address, pod name, ready); the pods
    named in ``terminating`` are terminating."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": address_type,
        "metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports.items()],
        "endpoints": [{"addresses": [address],
                       "conditions": {**({} if ready is None else {"ready": ready}),
                                      **({"terminating": True} if pod in terminating else {})},
                       **({"targetRef": {"kind": "Pod", "name": pod, "namespace": namespace}} if pod else {})}
                      for address, pod, ready in endpoints],
    }


class KubeAPI:
    """The server, from :meth:`start` to :meth:`stop`."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.failing = False
        self.cut_watches = False  # a watch ends at once, with no event (a proxy that closes streams)
        self.expire_watches = False  # every watch is answered 410 (a version no longer kept)
        self.requests = 0  # requests answered (lists and watches)
        self.watches = 0
        self._version = 1
        self._slices: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name): object
        self._history: list[tuple[int, str, dict[str, Any]]] = []  # (version, type, object)
        self._floor = 1  # the oldest version a watch may start from
        self._epoch = 0  # bumped by drop(): watches of an older epoch end
        self._cond = threading.Condition()
        self._server: ThreadingHTTPServer | None = None

    # --- the test's side -------------------------------------------------------------------------------------
    def start(self) -> KubeAPI:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # (a watch is streamed in chunks, as an API server streams it)

            def do_GET(self) -> None:
                api._answer(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig file that reaches this server with its token, in ``namespace``."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": self.token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test", "namespace": namespace}}],
        }))
        return path

    def apply(self, obj: dict[str, Any]) -> None:
        """Create or replace an EndpointSlice."""
        with self._cond:
            obj = copy.deepcopy(obj)
            key = (obj["metadata"].get("namespace", "default"), obj["metadata"]["name"])
            self._version += 1
            obj["metadata"]["resourceVersion"] = str(self._version)
            kind = "MODIFIED" if key in self._slices else "ADDED"
            self._slices[key] = obj
            self._history.append((self._version, kind, obj))
            self._cond.notify_all()

    def delete(self, name: str, namespace: str = "default") -> None:
        with self._cond:
            obj = self._slices.pop((namespace, name))
            self._version += 1
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self._version)}}
            self._history.append((self._version, "DELETED", obj))
            self._cond.notify_all()

    def compact(self) -> None:
        """Forget the history: a watch from an earlier version gets 410."""
        with self._cond:
            self._history.clear()
            self._floor = self._version
            self._cond.notify_all()

    def drop(self) -> None:
        """End every watch under way (as a restarted API server's connections end)."""
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()

    def stop(self) -> None:
        self.drop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # --- the client's side -----------------------------------------------------------------------------------
    def _answer(self, handler: BaseHTTPRequestHandler) -> None:
        parts = urllib.parse.urlsplit(handler.path)
        query = dict(urllib.parse.parse_qsl(parts.query))
        with self._cond:
            self.requests += 1
        if handler.headers.get("Authorization") != f"Bearer {self.token}":
            self._status(handler, 401, "Unauthorized", "no valid bearer token")
            return
        if self.failing:
            self._status(handler, 503, "ServiceUnavailable", "the API server is not ready")
            return
        if not parts.path.startswith(_PATH) or not parts.path.endswith("/endpointslices"):
            self._status(handler, 404, "NotFound", f"{parts.path} is not served here")
            return
        namespace = parts.path[len(_PATH):-len("/endpointslices")]
        selector = dict(term.split("=", 1) for term in query.get("labelSelector", "").split(",") if "=" in term)

        def selected(obj: dict[str, Any]) -> bool:
            labels = obj["metadata"].get("labels", {})
            return obj["metadata"].get("namespace", "default") == namespace and all(
                labels.get(k) == v for k, v in selector.items())

        if query.get("watch") in ("1", "true", "True"):
            self._watch(handler, query, selected)
            return
        with self._cond:
            items = [copy.deepcopy(o) for o in self._slices.values() if selected(o)]
            body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self._version)}, "items": items}
        self._json(handler, 200, body)

    def _watch(self, handler: BaseHTTPRequestHandler, query: dict[str, str], selected: Any) -> None:
        start = int(query.get("resourceVersion") or 0)
        ends = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")
        handler.end_headers()
        try:
            self._stream(handler, query, selected, start, ends)
        finally:
            self._chunk(handler, b"")  # the last chunk

    def _stream(self, handler: BaseHTTPRequestHandler, query: dict[str, str], selected: Any, start: int,
                ends: float) -> None:
        with self._cond:
            self.watches += 1
            if self.cut_watches:
                return
            epoch, sent = self._epoch, start
            if start < self._floor or self.expire_watches:
                status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
                          "message": f"too old resource version: {start} ({self._floor})", "code": 410}
                self._line(handler, {"type": "ERROR", "object": status})
                return
        while True:
            with self._cond:
                self._cond.wait_for(functools.partial(self._news, epoch, sent),
                                    timeout=max(0.0, ends - time.monotonic()))
                if self._epoch != epoch or self.failing or time.monotonic() >= ends:
                    if query.get("allowWatchBookmarks") in ("1", "true") and self._epoch == epoch:
                        self._line(handler, {"type": "BOOKMARK", "object": {
                            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                            "metadata": {"resourceVersion": str(self._version)}}})
                    return
                events = [(v, kind, copy.deepcopy(o)) for v, kind, o in self._history if v > sent]
                sent = self._version
            for _, kind, obj in events:
                if selected(obj) and not self._line(handler, {"type": kind, "object": obj}):
                    return

    def _news(self, epoch: int, sent: int) -> bool:
        """Whether a watch of ``epoch`` that sent up to version ``sent`` has something to do."""
        return self._epoch != epoch or self._version > sent or self.failing

    @classmethod
    def _line(cls, handler: BaseHTTPRequestHandler, event: dict[str, Any]) -> bool:
        return cls._chunk(handler, json.dumps(event).encode() + b"\n")

    @staticmethod
    def _chunk(handler: BaseHTTPRequestHandler, data: bytes) -> bool:
        try:
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            handler.wfile.flush()
            return True
        except OSError:  # the client left
            return False

    @staticmethod
    def _json(handler: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        handler.send_response(code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _status(self, handler: BaseHTTPRequestHandler, code: int, reason: str, message: str) -> None:
        self._json(handler, code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                                   "message": message, "code": code})

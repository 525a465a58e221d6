"""The webhook's memory stays bounded whoever calls it (any pod that reaches its Service can):
the body size, the bodies held and the reviews run at once, the time a body may take."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

from kai_fractions.admission import server
from kai_fractions.admission.review import allow

from .conftest import Webhook
from .reviews import pod, request


def send(webhook: Webhook, body: bytes, *, length: int | None = None,
         timeout: float = 5.0) -> tuple[int, str]:
    """POST /validate with `body` announced as `length` bytes (default: its own length), over
    a raw TLS socket: the answer may come before the body is whole."""
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    with socket.create_connection(("127.0.0.1", webhook.port), timeout=timeout) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(b"POST /validate HTTP/1.1\r\nHost: webhook\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length))
        sock.sendall(body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read().decode()


def review(obj: dict[str, Any]) -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": request(obj)}).encode()


def test_a_body_over_the_api_servers_own_limit_is_refused_unread(webhook: Webhook) -> None:
    """The API server reads no write request over 3 MiB; a larger body is answered 413 at once
    from its Content-Length, without being read."""
    assert server.MAX_BODY == 3 * 1024 * 1024
    status, text = send(webhook, b"", length=server.MAX_BODY + 1)
    assert (status, text) == (413, (
        f"the body is {server.MAX_BODY + 1} bytes, larger than the {server.MAX_BODY} bytes an "
        "AdmissionReview can take (the API server's own request limit)\n"))


def test_a_body_that_does_not_arrive_in_time_is_a_408(webhook: Webhook,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "BODY_DEADLINE", 0.5)
    status, text = send(webhook, b'{"apiVersion"', length=1000)
    assert (status, text) == (408, "the body did not arrive within 0.5 s (13 of 1000 bytes)\n")


def test_a_body_nested_deeper_than_any_object_is_a_400(webhook: Webhook) -> None:
    status, text = send(webhook, b"[" * 100_000 + b"]" * 100_000)
    assert (status, text) == (400, "the request body is not an AdmissionReview: it nests "
                                   "deeper than any Kubernetes object\n")


def test_at_most_two_reviews_run_at_once(webhook: Webhook,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Each parsed body can take tens of times its size: the chart's memory limit holds two."""
    running, most = 0, 0
    lock = threading.Lock()

    def slow(request: Mapping[str, Any], config: Any) -> Any:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.2)
        with lock:
            running -= 1
        return allow()

    monkeypatch.setitem(server.ROUTES, "/validate", slow)
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(send(webhook, review(pod()))[0]))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [200] * 6
    assert most == server.MAX_REVIEWS == 2


@pytest.mark.parametrize("slots", ["bodies", "reviews"])
def test_a_webhook_without_room_answers_503_and_serves_again_once_it_has(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch, slots: str) -> None:
    monkeypatch.setattr(server, "QUEUE_WAIT", 0.3)
    semaphore = getattr(webhook.server, slots)
    held = 0
    while semaphore.acquire(blocking=False):
        held += 1
    assert held == {"bodies": server.MAX_BODIES, "reviews": server.MAX_REVIEWS}[slots]
    try:
        status, text = send(webhook, review(pod()))
        assert (status, text) == (503, "the webhook is busy with other reviews and found no "
                                       "room within 0.3 s; try again\n")
    finally:
        for _ in range(held):
            semaphore.release()
    assert send(webhook, review(pod()))[0] == 200


def test_a_long_denial_is_logged_cut(webhook: Webhook, caplog: pytest.LogCaptureFixture) -> None:
    volumes = [{"name": f"v{i}", "hostPath": {"path": "/" + "a/../" * 800}} for i in range(50)]
    with caplog.at_level(logging.INFO, logger=server.__name__):
        status, answer = webhook.post("/validate", review(pod({}, volumes=volumes)))
    assert status == 200 and answer["response"]["allowed"] is False
    [line] = [r.getMessage() for r in caplog.records if "denied:" in r.getMessage()]
    assert len(line) < 2200
    assert line.endswith(f"... ({len(answer['response']['status']['message'])} characters)")


# -- connections (each is a thread) -----------------------------------------------------------


def _wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_connection_flood_costs_at_most_the_connection_limit_in_threads(
        webhook: Webhook) -> None:
    """Connections that never start TLS (or idle keep-alives) hold a thread each: past the
    limit, the one that has waited longest makes way, and a real review is still served."""
    webhook.server.connections.limit = 4
    threads_before = threading.active_count()
    flood = [socket.create_connection(("127.0.0.1", webhook.port), timeout=5)
             for _ in range(12)]
    try:
        _wait_for(lambda: webhook.server.connections.evicted == 8)
        assert len(webhook.server.connections) == 4
        _wait_for(lambda: threading.active_count() <= threads_before + 4)  # evicted ones end
        assert all(_closed_by_peer(s) for s in flood[:8])  # the oldest went first
        assert send(webhook, review(pod()))[0] == 200  # took the place of flood[8]
        assert _closed_by_peer(flood[8])
    finally:
        for s in flood:
            s.close()


def test_when_every_connection_is_being_served_a_new_one_is_closed_at_once(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Requests whose bodies are on their way are being served (each within BODY_DEADLINE): a
    new connection finds no place to take and is closed with a warning, once a minute."""
    monkeypatch.setattr(server, "BODY_DEADLINE", 2.0)
    webhook.server.connections.limit = 2
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    served = []
    for _ in range(2):
        sock = context.wrap_socket(socket.create_connection(("127.0.0.1", webhook.port),
                                                            timeout=5),
                                   server_hostname="127.0.0.1")
        sock.sendall(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Length: 100\r\n\r\n")
        served.append(sock)
    try:
        _wait_for(lambda: webhook.server.connections.refused == 0 and not any(
            idle for idle, _since in webhook.server.connections._open.values()))
        with caplog.at_level(logging.WARNING, logger=server.__name__):
            for _ in range(2):
                extra = socket.create_connection(("127.0.0.1", webhook.port), timeout=5)
                assert _closed_by_peer(extra)
                extra.close()
        assert webhook.server.connections.refused == 2
        [warning] = [r.getMessage() for r in caplog.records if "closed a connection" in
                     r.getMessage()]
        assert warning == ("closed a connection from 127.0.0.1 at once: all 2 connections are "
                           "being served (1 closed so far)")
        for sock in served:  # their bodies never came: 408 after the deadline, then closed
            response = http.client.HTTPResponse(sock)
            response.begin()
            assert response.status == 408
        _wait_for(lambda: len(webhook.server.connections) == 0)
        assert send(webhook, review(pod()))[0] == 200
    finally:
        for sock in served:
            sock.close()


def test_a_keep_alive_connection_waits_between_requests_and_can_make_way(
        webhook: Webhook) -> None:
    """The API server's idle keep-alive connection is a place a new connection may take: it
    sees the connection end (as Go's pool does, which drops it) and connects again."""
    webhook.server.connections.limit = 1
    conn = webhook.connect()
    try:
        conn.request("POST", "/validate", body=review(pod()))
        assert conn.getresponse().read() and len(webhook.server.connections) == 1
        assert send(webhook, review(pod()))[0] == 200  # made way for this one
        assert webhook.server.connections.evicted == 1
        assert _closed_by_peer(conn.sock)
        conn.close()
        conn.request("POST", "/validate", body=review(pod()))  # a new connection
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_a_peer_that_reads_its_answers_slowly_is_waited_on_and_can_make_way(
        webhook: Webhook) -> None:
    """Pipelined requests whose answers are never read leave the server writing, blocked on
    the peer: that connection is waiting, not being served, so a review still finds a place
    (and no room for reviews is held while an answer is written)."""
    webhook.server.connections.limit = 1
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", webhook.port))
    slow = context.wrap_socket(raw, server_hostname="127.0.0.1")
    flooding = threading.Thread(target=lambda: _quietly(
        slow.sendall, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 60_000), daemon=True)
    flooding.start()
    def write_blocked() -> bool:
        """The server's answers filled the socket's buffers: its write has not moved for a
        while (each answer's write marks the connection again)."""
        [(waiting, since)] = webhook.server.connections._open.values()
        return waiting and time.monotonic() - since > 0.5

    try:
        _wait_for(write_blocked, timeout=30)
        assert send(webhook, review(pod()))[0] == 200
        assert webhook.server.connections.evicted == 1 and webhook.server.connections.refused == 0
    finally:
        slow.close()


def _quietly(write: Any, data: bytes) -> None:
    with contextlib.suppress(OSError):
        write(data)


def test_a_connection_whose_place_was_taken_mid_request_stops_there(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its headers end with the stream: it must not go on to wait for room (QUEUE_WAIT) as a
    thread no limit counts."""
    monkeypatch.setattr(server, "QUEUE_WAIT", 3.0)
    webhook.server.connections.limit = 1
    for _ in range(server.MAX_BODIES):  # no room: a request past its headers would wait
        webhook.server.bodies.acquire()
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    baseline = threading.active_count()
    try:
        with context.wrap_socket(socket.create_connection(("127.0.0.1", webhook.port)),
                                 server_hostname="127.0.0.1") as partial:
            partial.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n")
            _wait_for(lambda: threading.active_count() == baseline + 1)
            with socket.create_connection(("127.0.0.1", webhook.port)):  # takes its place
                _wait_for(lambda: webhook.server.connections.evicted == 1)
                assert _closed_by_peer(partial)
                _wait_for(lambda: threading.active_count() == baseline + 1, timeout=1.5)
    finally:
        for _ in range(server.MAX_BODIES):
            webhook.server.bodies.release()

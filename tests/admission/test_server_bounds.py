"""The webhook's memory stays bounded whoever calls it (any pod that reaches its Service can):
the body size, the bodies held and the reviews run at once, the time a body may take."""

from __future__ import annotations

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

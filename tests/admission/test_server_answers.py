"""An answer takes memory too: it holds its share of the body budget until it is written, and
must be read at the body rate. Written with nothing held and 30 s per send, the answers of
peers that never read them took the process past the chart's memory limit (100 fractional pods
with a 3 MiB env value, each answered with a 4 MiB patch: 550 MiB)."""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Mapping
from typing import Any

import pytest

from kai_fractions.admission import handler, server
from kai_fractions.admission.review import allow

from .conftest import Webhook
from .reviews import pod
from .test_server_bounds import _wait_for, exchange, review


def _answer_of(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """/validate answers with a patch of a value `size` bytes long (base64: 4/3 of it)."""

    def big(request: Mapping[str, Any], config: Any) -> Any:
        return allow(patch=({"op": "add", "path": "/metadata/labels/x", "value": "A" * size},))

    monkeypatch.setitem(server.ROUTES, "/validate", big)


def _non_reader(webhook: Webhook) -> ssl.SSLSocket:
    """A TLS connection with a small receive window, on which a review was sent and whose answer
    is not read: the server's write of a large one stops, its socket's buffers full."""
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.settimeout(20)
    raw.connect(("127.0.0.1", webhook.port))
    sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
    body = review(pod())
    sock.sendall(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Length: %d\r\n\r\n"
                 % len(body) + body)
    return sock


def test_an_answer_holds_its_room_until_it_is_written(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer (4 MB for a body of a few KiB) is counted in the budget while its peer has
    not read it, and given back once written. It was given back before the write."""
    monkeypatch.setattr(handler, "BODY_GRACE", 60.0)  # however slowly this test reads it
    _answer_of(monkeypatch, 3_000_000)
    budget = webhook.server.bodies
    sock = _non_reader(webhook)
    try:
        _wait_for(lambda: budget.size - budget.free >= 4_000_000, timeout=20)
        response = http.client.HTTPResponse(sock)
        response.begin()
        answer = response.read()
        assert response.status == 200 and len(answer) >= 4_000_000
        # the larger of the body and the answer was held: the answer
        _wait_for(lambda: budget.free == budget.size)
    finally:
        sock.close()


def test_an_answer_not_read_in_time_is_cut_and_its_room_given_back(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its write must end within BODY_GRACE + its length / BODY_RATE: then the connection is
    closed and what it held is free. It could wait IO_TIMEOUT for each send."""
    monkeypatch.setattr(handler, "BODY_GRACE", 0.5)
    monkeypatch.setattr(handler, "BODY_RATE", 8 * 1024 * 1024)
    monkeypatch.setattr(handler, "IO_TIMEOUT", 600.0)
    _answer_of(monkeypatch, 6_000_000)  # 8 MB: more than the socket buffers hold
    budget = webhook.server.bodies
    sock = _non_reader(webhook)
    try:
        _wait_for(lambda: budget.size - budget.free >= 8_000_000, timeout=20)
        _wait_for(lambda: len(webhook.server.connections) == 0, timeout=30)
        assert budget.free == budget.size
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200
        with pytest.raises(http.client.IncompleteRead):
            response.read()
    finally:
        sock.close()


def test_an_answer_that_finds_no_room_is_a_503(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the answer is larger than its body and the rest of the budget is taken, it gets
    503 at once (it holds its body's room already: requests waiting while each holds a part
    could hold all of it between them), with a Retry-After: the API server asks again."""
    _answer_of(monkeypatch, 1_000_000)
    budget = webhook.server.bodies
    assert budget.take(budget.size - 100_000, timeout=0)
    try:
        status, text, headers = exchange(webhook, review(pod()))
        assert (status, headers["Retry-After"]) == (503, "1")
        assert text.startswith("the webhook is busy with other reviews")
        assert budget.free == 100_000
    finally:
        budget.give(budget.size - 100_000)
    status, _text, _headers = exchange(webhook, review(pod()), timeout=20)
    assert status == 200
    assert budget.free == budget.size


def test_answers_written_at_once_hold_nothing_after(webhook: Webhook) -> None:
    """Real answers, read as the API server reads them: the budget is whole after each."""
    for path in ("/validate", "/mutate"):
        status, _answer = webhook.post(path, review(pod()))
        assert status == 200
    assert webhook.server.bodies.free == webhook.server.bodies.size


def test_the_standard_librarys_own_answers_are_written_as_ours_are(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unsupported method's 501 (written by http.server's send_error) waits on its peer as a
    WRITING connection, which may make way, within BODY_GRACE a send: it was written as a
    request being served, its place held for up to IO_TIMEOUT a send."""
    states: list[str] = []
    connections = webhook.server.connections
    mark = connections.mark

    def recording(conn: Any, state: str, *args: Any) -> bool:
        states.append(state)
        return mark(conn, state, *args)

    monkeypatch.setattr(connections, "mark", recording)
    conn = webhook.connect()
    try:
        conn.request("PUT", "/validate", body=b"{}")
        response = conn.getresponse()
        assert (response.status, response.getheader("Connection")) == (501, "close")
    finally:
        conn.close()
    assert states[-1] == server.WRITING

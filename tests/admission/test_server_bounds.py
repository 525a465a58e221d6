"""The webhook's memory stays bounded whoever calls it (any pod that reaches its Service can):
the body size, the bodies held and the reviews run at once, the time a body may take; and a
review the API server sends is answered, never cut off, however many come at once."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

from kai_fractions.admission import connections as connection_table
from kai_fractions.admission import handler, server
from kai_fractions.admission import review as reviews
from kai_fractions.admission.review import allow

from .conftest import Webhook
from .reviews import pod, request


def send(webhook: Webhook, body: bytes, *, length: int | None = None,
         timeout: float = 5.0) -> tuple[int, str]:
    """POST /validate with `body` announced as `length` bytes (default: its own length), over
    a raw TLS socket: the answer may come before the body is whole."""
    status, text, _headers = exchange(webhook, body, length=length, timeout=timeout)
    return status, text


def exchange(webhook: Webhook, body: bytes, *, length: int | None = None,
             timeout: float = 5.0) -> tuple[int, str, http.client.HTTPMessage]:
    """`send`, with the answer's headers."""
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    with socket.create_connection(("127.0.0.1", webhook.port), timeout=timeout) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(b"POST /validate HTTP/1.1\r\nHost: webhook\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length))
        sock.sendall(body)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read().decode(), response.headers


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
    monkeypatch.setattr(handler, "BODY_GRACE", 0.5)
    status, text = send(webhook, b'{"apiVersion"', length=1000)
    assert (status, text) == (408, "the body did not arrive within 0.5 s (13 of 1000 bytes): a "
                                   "body must come within 0.5 s and 1 s more per 1 MiB\n")


def _trickle(webhook: Webhook, length: int, answers: list[tuple[int, str]],
             stop: threading.Event) -> None:
    """Announces a body of `length` bytes and sends a byte of it every 0.2 s (a slowloris)
    until it is answered."""
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    with socket.create_connection(("127.0.0.1", webhook.port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(b"POST /validate HTTP/1.1\r\nHost: webhook\r\n"
                     b"Content-Length: %d\r\n\r\n" % length)
        while not stop.is_set() and not select.select([sock], [], [], 0.2)[0]:
            sock.sendall(b" ")
        response = http.client.HTTPResponse(sock)
        response.begin()
        answers.append((response.status, response.read().decode()))


def test_slow_senders_hold_no_room_and_are_cut_at_the_body_rate(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bodies that trickle in (headers at once, then a byte now and then) hold only the bytes
    that came, and are cut when they fall behind the body rate: a real review sent meanwhile
    is answered, not kept waiting for room (it waited QUEUE_WAIT for a body slot, then got 503,
    while MAX_BODIES slow senders held theirs for 10 s each)."""
    monkeypatch.setattr(handler, "QUEUE_WAIT", 1.0)
    answers: list[tuple[int, str]] = []
    stop = threading.Event()
    slow = [threading.Thread(target=_trickle, args=(webhook, 100_000, answers, stop),
                             daemon=True) for _ in range(2 * server.MAX_BODIES)]
    for t in slow:
        t.start()
    try:
        _wait_for(lambda: _states(webhook).count(server.READING) >= server.MAX_BODIES)
        assert send(webhook, review(pod()))[0] == 200
        for t in slow:
            t.join(timeout=10)
    finally:
        stop.set()
    assert [status for status, _text in answers] == [408] * len(slow)
    assert answers[0][1].startswith("the body did not arrive within 1.1 s (")
    assert webhook.server.bodies.free == webhook.server.bodies.size


def test_a_body_nested_deeper_than_any_object_is_a_400(webhook: Webhook) -> None:
    status, text = send(webhook, b"[" * 100_000 + b"]" * 100_000)
    assert (status, text) == (400, "the request body is not an AdmissionReview: it nests "
                                   "deeper than any Kubernetes object\n")


def test_a_body_opening_more_arrays_than_any_object_is_refused_unparsed(
        webhook: Webhook) -> None:
    """Small nested arrays parse to ~44 times their size: eight such 3 MiB bodies at once took
    the process past the chart's memory limit. Counted before parsing."""
    head = (b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview",'
            b'"request":{"uid":"u","object":[')
    unit = b"[" * 100 + b"]" * 100 + b","
    body = head + unit * ((server.MAX_BODY - len(head)) // len(unit) - 1) + b"[]]}}"
    assert len(body) <= server.MAX_BODY
    openings = body.count(b"[") + body.count(b"{")
    assert openings > reviews.MAX_OPENINGS == 200_000
    status, text = send(webhook, body, timeout=30)
    assert (status, text) == (400, (
        f"the request body opens {openings} arrays and objects ('[' and '{{' outside strings), "
        "more than the 200000 any AdmissionReview of a real object does; refused unparsed, as "
        "each takes memory\n"))


def test_brackets_inside_strings_are_not_counted(webhook: Webhook) -> None:
    """A pod whose app reads a JSON config from its env (600 KB of `[[0,0],...]`: 100,000
    brackets), twice in an UPDATE (the binder's, the kubelet's status): reviewed. Counting the
    brackets inside strings too, its every UPDATE was refused (200,108), so it never got its
    binding nor its status."""
    points = json.dumps([[0, 0]] * 100_001, separators=(",", ":"))
    obj = pod({})
    obj["spec"]["containers"][0]["env"] = [{"name": "POINTS_JSON", "value": points}]
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": request(obj, old=obj)}).encode()
    assert body.count(b"[") + body.count(b"{") > reviews.MAX_OPENINGS
    status, answer = webhook.post("/validate", body)
    assert status == 200 and answer["response"]["allowed"] is True


def _structures(value: Any) -> int:
    """The arrays and objects in a parsed value."""
    if isinstance(value, list):
        return 1 + sum(_structures(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(_structures(v) for v in value.values())
    return 0


@pytest.mark.parametrize("text", ['[{', 'a\\"[{', '\\', '\\\\"[', '"', '\u2200[{', '\n[\t', ''])
@pytest.mark.parametrize("ascii_only", [True, False])
def test_openings_are_the_arrays_and_objects_the_parser_builds(text: str,
                                                               ascii_only: bool) -> None:
    """Strings (their escapes, quotes and brackets) are skipped as json.loads reads them."""
    doc = {"k": text, "l": [text, {"m": [text, []]}], text: [[{}]], "n": [1, "]", "["]}
    body = json.dumps(doc, ensure_ascii=ascii_only).encode()
    assert reviews.openings(body) == _structures(json.loads(body)) == 9


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_in_utf16_or_utf32_every_bracket_counts(encoding: str) -> None:
    """json.loads reads those too; there a character's bytes may be a quote's (U+2200 is 22 00
    in UTF-16-BE), and strings read from the bytes would hide the brackets after it."""
    body = json.dumps(["\u2200", [[[]]] * 1000, "\u2200"], ensure_ascii=False).encode(encoding)
    assert _structures(json.loads(body)) == 2002
    assert reviews.openings(body) >= 2002


def test_counting_openings_takes_one_pass_whatever_the_body(tmp_path: Any) -> None:
    """3 MiB of unterminated strings of escaped quotes, or of backslashes: one pattern for a
    whole string with its escapes backtracks over the string from each quote in it (18 s for
    80 KB; days for 3 MiB). Counted in a process of its own, so that such a regression fails
    (the timeout only keeps the suite from hanging)."""
    code = ("from kai_fractions.admission.review import openings\n"
            "n = 3 * 1024 * 1024 // 2\n"
            "print(openings(b'\"' + b'\\\\\"' * n), openings(b'\"\\\\' * n),"
            " openings(b'[\"' + b'\\\\' * n))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "0 0 1\n"), result.stderr


def _big_pod(containers: int, envs: int) -> dict[str, Any]:
    """A pod of `containers` x `envs` env vars, with the managedFields kubectl's apply gives
    them and its last-applied-configuration annotation (JSON in a string)."""
    obj = pod({}, containers=tuple(f"c{c}" for c in range(containers)))
    for c, container in enumerate(obj["spec"]["containers"]):
        container["env"] = [{"name": f"ENV_VAR_{c}_{e}", "value": f"value-{e}"}
                            for e in range(envs)]
    fields = {"f:spec": {"f:containers": {
        f'k:{{"name":"{container["name"]}"}}': {".": {}, "f:name": {}, "f:image": {}, "f:env": {
            ".": {}, **{f'k:{{"name":"{e["name"]}"}}': {".": {}, "f:name": {}, "f:value": {}}
                        for e in container["env"]}}}
        for container in obj["spec"]["containers"]}}}
    last = json.dumps({"spec": obj["spec"]}, separators=(",", ":"))
    obj["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] = \
        last[:256 * 1024 - 100]  # annotations hold 256 KiB at most
    obj["metadata"]["managedFields"] = [{"manager": "kubectl-client-side-apply",
                                         "operation": "Update", "fieldsType": "FieldsV1",
                                         "fieldsV1": fields}]
    return obj


def test_an_update_of_a_pod_of_ten_thousand_env_vars_is_reviewed(webhook: Webhook) -> None:
    """A pod near etcd's 1.5 MiB, with its managedFields and a last-applied-configuration
    annotation, twice in an UPDATE: well within both MAX_BODY and MAX_OPENINGS."""
    obj = _big_pod(10, 1000)
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": request(obj, old=obj)}, separators=(",", ":")).encode()
    assert len(body) <= server.MAX_BODY
    assert body.count(b"[") + body.count(b"{") < reviews.MAX_OPENINGS * 2 // 3
    status, answer = webhook.post("/validate", body)
    assert status == 200 and answer["response"]["allowed"] is True


def test_one_review_runs_at_a_time(webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each parsed body can take tens of times its size: the chart's memory limit holds one of
    the costliest (two reached 384 MiB)."""
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
    assert most == server.MAX_REVIEWS == 1


def test_the_bodies_held_at_once_are_counted_in_bytes(webhook: Webhook) -> None:
    assert server.BODY_BUDGET == server.MAX_BODIES * server.MAX_BODY
    assert webhook.server.bodies.size == server.BODY_BUDGET


def test_a_body_waits_for_room_only_while_it_holds_none(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that has some of the budget and finds no room for more is answered 503 at once
    (bodies waiting on each other while each holds a part could hold it all, for QUEUE_WAIT);
    one that has none waits for room."""
    monkeypatch.setattr(handler, "QUEUE_WAIT", 30.0)
    budget = webhook.server.bodies
    assert budget.take(budget.size - 20_000, timeout=0)
    try:
        status, _text, headers = exchange(webhook, b" " * 100_000)
        assert (status, headers["Retry-After"]) == (503, "1")
        assert budget.free == 20_000
        assert budget.take(20_000, timeout=0)
        waiting, answer = _in_thread(lambda: send(webhook, review(pod()), timeout=20))
        _wait_for(lambda: _states(webhook) == [server.SERVING])
        time.sleep(0.3)
        assert waiting.is_alive()  # waiting for room
        budget.give(budget.size)
        waiting.join(timeout=20)
        assert answer[0][0] == 200
    finally:
        budget.free = budget.size


def _hold(slots: str, webhook: Webhook) -> Any:
    """Takes all the room of `slots`; returns what gives it back."""
    if slots == "bodies":
        budget = webhook.server.bodies
        assert budget.take(budget.size, timeout=0)
        return lambda: budget.give(budget.size)
    semaphore = webhook.server.reviews
    held = 0
    while semaphore.acquire(blocking=False):
        held += 1
    assert held == server.MAX_REVIEWS
    return lambda: [semaphore.release() for _ in range(held)]


@pytest.mark.parametrize("slots", ["bodies", "reviews"])
def test_a_webhook_without_room_answers_503_and_serves_again_once_it_has(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch, slots: str) -> None:
    """With a Retry-After: the API server's client retries a 5xx only with one."""
    monkeypatch.setattr(handler, "QUEUE_WAIT", 0.3)
    give_back = _hold(slots, webhook)
    try:
        status, text, headers = exchange(webhook, review(pod()))
        assert (status, text) == (503, "the webhook is busy with other reviews and found no "
                                       "room within 0.3 s; try again\n")
        assert headers["Retry-After"] == "1"
    finally:
        give_back()
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


def _states(webhook: Webhook) -> list[str]:
    return [state for state, _since in webhook.server.connections._open.values()]


def _tls(webhook: Webhook) -> ssl.SSLSocket:
    """A TLS connection to the webhook, its handshake done."""
    context = ssl.create_default_context(cafile=str(webhook.ca_file))
    return context.wrap_socket(socket.create_connection(("127.0.0.1", webhook.port), timeout=10),
                               server_hostname="127.0.0.1")


def _review_over(sock: ssl.SSLSocket) -> int:
    body = review(pod())
    sock.sendall(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Length: %d\r\n\r\n"
                 % len(body) + body)
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response.status


def _in_thread(target: Any) -> tuple[threading.Thread, list[Any]]:
    """Runs `target()`; its result (or the exception it raised) lands in the list."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(target())
        except Exception as e:
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_review_on_its_way_is_never_cut_off_for_a_new_connection(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections whose handshake or request is on its way (as in a burst of pod creations)
    keep their place: a new connection past the limit waits to be accepted (it was accepted
    and the connection that had waited longest was closed, its review unanswered)."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 30.0)
    webhook.server.connections.limit = 4
    first = [_tls(webhook) for _ in range(4)]  # handshakes done, requests not sent yet
    try:
        _wait_for(lambda: _states(webhook) == [server.NEW] * 4)
        late, late_status = _in_thread(lambda: send(webhook, review(pod()), timeout=20))
        _wait_for(lambda: webhook.server.connections.waited >= 1)
        time.sleep(0.2)
        assert webhook.server.connections.evicted == 0 and late.is_alive()
        # Answered, each of them goes idle: a place the late one may take.
        assert [_review_over(sock) for sock in first] == [200] * 4
        late.join(timeout=20)
        assert late_status == [(200, late_status[0][1])]
    finally:
        for sock in first:
            sock.close()


def test_a_burst_of_reviews_past_the_connection_limit_is_answered_whole(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight times the limit of fresh connections at once, each sending its review a moment
    after its handshake: every one is answered 200 (past the limit they wait to be accepted),
    none closed unanswered."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 30.0)
    webhook.server.connections.limit = 8

    def client() -> int:
        with _tls(webhook) as sock:
            time.sleep(0.1)
            return _review_over(sock)

    burst = [_in_thread(client) for _ in range(64)]
    for thread, _out in burst:
        thread.join(timeout=60)
    assert [out[0] if out else None for _thread, out in burst] == [200] * 64


def test_a_connection_flood_costs_at_most_the_connection_limit_in_threads(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections that never start TLS (or idle keep-alives) hold a thread each: past the
    limit, one that has waited PENDING_GRACE on its peer makes way, the oldest first, and a
    real review is still served."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 0.2)
    webhook.server.connections.limit = 4
    threads_before = threading.active_count()
    flood = [socket.create_connection(("127.0.0.1", webhook.port), timeout=5)
             for _ in range(12)]
    try:
        # The 12th is admitted just after the eviction that makes its room is counted.
        _wait_for(lambda: webhook.server.connections.evicted == 8
                  and len(webhook.server.connections) == 4)
        _wait_for(lambda: threading.active_count() <= threads_before + 4)  # evicted ones end
        assert all(_closed_by_peer(s) for s in flood[:8])  # the oldest went first
        assert send(webhook, review(pod()))[0] == 200  # took the place of flood[8]
        assert _closed_by_peer(flood[8])
    finally:
        for s in flood:
            s.close()


def test_when_every_connection_is_being_served_a_new_one_waits_to_be_accepted(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Requests whose bodies are on their way are being served (each within its body's
    deadline, and less than PENDING_GRACE behind the body rate): a new connection is not
    accepted until one ends, with a warning, once a minute. It was closed at once."""
    monkeypatch.setattr(handler, "BODY_GRACE", 1.0)
    webhook.server.connections.limit = 2
    served = []
    for _ in range(2):
        sock = _tls(webhook)
        sock.sendall(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Length: 100\r\n\r\n")
        served.append(sock)
    try:
        _wait_for(lambda: _states(webhook) == [server.READING] * 2)
        with caplog.at_level(logging.WARNING, logger=server.__name__):
            late, late_status = _in_thread(lambda: send(webhook, review(pod()), timeout=20))
            _wait_for(lambda: webhook.server.connections.waited >= 1)
            for sock in served:  # their bodies never came: 408 after the deadline, then closed
                response = http.client.HTTPResponse(sock)
                response.begin()
                assert response.status == 408
            late.join(timeout=20)
        assert late_status[0][0] == 200
        assert webhook.server.connections.evicted == 0
        [warning] = [r.getMessage() for r in caplog.records if "connections are" in
                     r.getMessage()]
        assert warning == ("all 2 connections are busy: new connections wait in the listen "
                           "backlog (1 so far)")
    finally:
        for sock in served:
            sock.close()


def test_a_body_that_does_not_come_makes_way_for_a_new_connection(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers announcing a body, then nothing: once PENDING_GRACE behind the body rate, its
    place may be taken. It was a request being served, its place held until its 408."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 0.2)
    monkeypatch.setattr(handler, "BODY_GRACE", 60.0)  # no 408 meanwhile
    webhook.server.connections.limit = 1
    with _tls(webhook) as stalled:
        stalled.sendall(b"POST /validate HTTP/1.1\r\nHost: webhook\r\n"
                        b"Content-Length: 3000000\r\n\r\n" + b" " * 1000)
        _wait_for(lambda: _states(webhook) == [server.READING])
        assert send(webhook, review(pod()), timeout=30)[0] == 200
        assert webhook.server.connections.evicted == 1
        assert _closed_by_peer(stalled)
    assert webhook.server.bodies.free == webhook.server.bodies.size


def test_a_body_coming_at_the_body_rate_keeps_its_place(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """However long it takes, a body ahead of BODY_RATE is never behind it: a new connection
    waits for its place, and both are answered."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 1.0)
    monkeypatch.setattr(handler, "BODY_RATE", 10_000)
    webhook.server.connections.limit = 1
    body = json.dumps({**json.loads(review(pod())), "padding": " " * 30_000}).encode()

    def steady() -> int:
        with _tls(webhook) as sock:
            sock.sendall(b"POST /validate HTTP/1.1\r\nHost: webhook\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            for start in range(0, len(body), 1000):  # 40,000 bytes a second
                sock.sendall(body[start:start + 1000])
                time.sleep(0.025)
            return _answer_status(sock)

    sender, sent = _in_thread(steady)
    _wait_for(lambda: _states(webhook) == [server.READING])
    late, late_status = _in_thread(lambda: send(webhook, review(pod()), timeout=30))
    sender.join(timeout=30)
    late.join(timeout=30)
    assert sent == [200]
    assert late_status[0][0] == 200
    assert webhook.server.connections.waited >= 1
    assert webhook.server.connections.evicted <= 1  # its keep-alive after the answer, if any


def test_a_keep_alive_whose_next_request_has_begun_is_no_longer_idle(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a byte of its next request has come, the API server's keep-alive is not a place to
    take at once: a new connection waits for it to be answered (it was closed mid-request)."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 30.0)
    webhook.server.connections.limit = 1
    with _tls(webhook) as sock:
        assert _review_over(sock) == 200
        _wait_for(lambda: _states(webhook) == [server.IDLE])
        body = review(pod())
        request_ = (b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Length: %d\r\n\r\n"
                    % len(body) + body)
        sock.sendall(request_[:10])
        _wait_for(lambda: _states(webhook) == [server.HEADERS])
        late, late_status = _in_thread(lambda: send(webhook, review(pod()), timeout=30))
        _wait_for(lambda: webhook.server.connections.waited >= 1)
        assert webhook.server.connections.evicted == 0 and late.is_alive()
        sock.sendall(request_[10:])
        assert _answer_status(sock) == 200
        late.join(timeout=30)
        assert late_status[0][0] == 200
        assert webhook.server.connections.evicted == 1  # idle again after its answer


def test_on_drain_a_connection_that_sends_no_request_holds_it_only_pending_grace(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection accepted before the listener closed, that never sends a request, is closed
    after PENDING_GRACE: the drain ends then (it waited its whole timeout, and said some
    request was not answered)."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 0.3)
    with socket.create_connection(("127.0.0.1", webhook.port), timeout=5) as silent, \
            _tls(webhook) as quiet:
        _wait_for(lambda: _states(webhook) == [server.NEW] * 2)
        began = time.monotonic()
        assert webhook.server.drain(timeout=10) is True
        assert time.monotonic() - began < 5
        assert _closed_by_peer(silent) and _closed_by_peer(quiet)


def test_on_drain_a_request_begun_within_pending_grace_is_answered(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API server sends its request at once after its handshake: one that begins within
    PENDING_GRACE of its connection is answered (with Connection: close) before the drain
    ends."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 3.0)
    with _tls(webhook) as sock:
        _wait_for(lambda: _states(webhook) == [server.NEW])
        drain, drained = _in_thread(lambda: webhook.server.drain(timeout=10))
        _wait_for(lambda: webhook.server.draining)
        assert _review_over(sock) == 200
        drain.join(timeout=10)
        assert drained == [True]
        assert _closed_by_peer(sock)


def _answer_status(sock: ssl.SSLSocket) -> int:
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response.status


def test_a_keep_alive_connection_waits_between_requests_and_can_make_way(
        webhook: Webhook) -> None:
    """The API server's idle keep-alive connection is a place a new connection may take at
    once: it sees the connection end (as Go's pool does, which drops it) and connects again."""
    webhook.server.connections.limit = 1
    conn = webhook.connect()
    try:
        conn.request("POST", "/validate", body=review(pod()))
        assert conn.getresponse().read() and len(webhook.server.connections) == 1
        _wait_for(lambda: _states(webhook) == [server.IDLE])
        assert send(webhook, review(pod()))[0] == 200  # made way for this one
        assert webhook.server.connections.evicted == 1
        assert _closed_by_peer(conn.sock)
        conn.close()
        conn.request("POST", "/validate", body=review(pod()))  # a new connection
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def test_a_peer_that_reads_its_answers_slowly_is_waited_on_and_can_make_way(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pipelined requests whose answers are never read leave the server writing, blocked on
    the peer: once its write has not moved for PENDING_GRACE, a review takes its place (and no
    room for reviews is held while an answer is written)."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 0.3)
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
        [(state, since)] = webhook.server.connections._open.values()
        return state == server.WRITING and time.monotonic() - since > 0.5

    try:
        _wait_for(write_blocked, timeout=30)
        assert send(webhook, review(pod()))[0] == 200
        assert webhook.server.connections.evicted == 1
    finally:
        slow.close()


def _quietly(write: Any, data: bytes) -> None:
    with contextlib.suppress(OSError):
        write(data)


def test_a_connection_whose_place_was_taken_mid_request_stops_there(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its headers end with the stream: it must not go on to wait for room (QUEUE_WAIT) as a
    thread no limit counts."""
    monkeypatch.setattr(handler, "QUEUE_WAIT", 3.0)
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 0.2)
    webhook.server.connections.limit = 1
    give_back = _hold("bodies", webhook)  # no room: a request past its headers would wait
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
        give_back()


def test_connection_threads_start_with_a_small_stack(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """THREAD_STACK for each connection's thread (1024 of them), and the default again for the
    process's other threads."""
    sizes: list[int] = []
    start = threading.Thread.start

    def recording(thread: threading.Thread) -> None:
        sizes.append(threading.stack_size())
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording)
    assert send(webhook, review(pod()))[0] == 200
    assert sizes == [server.THREAD_STACK]
    assert threading.stack_size() == 0
    assert server.MAX_CONNECTIONS == 1024


def test_the_deepest_body_json_reads_is_reviewed_in_a_connection_thread(
        webhook: Webhook) -> None:
    """json.loads nests as deep as the recursion limit: reviewed (and answered) within
    THREAD_STACK, wherever in the review the nesting is."""
    for depth in (400, 700, 990):
        for field in ("namespace", "object"):
            for opening, closing in ((b"[", b"]"), (b'{"a":', b"}")):
                nested = opening * depth + b"0" * (opening == b"{\"a\":") + closing * depth
                body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                   "request": {**request(pod()), field: "@"}}).encode()
                for path in ("/validate", "/mutate"):
                    status, _answer = webhook.post(path, body.replace(b'"@"', nested))
                    assert status in (200, 400), (depth, field, path)
    assert send(webhook, review(pod()))[0] == 200


@pytest.mark.parametrize(("value", "status", "said"), [
    (b"\xb2", 411, "a Content-Length header of decimal digits is required"),
    (b"9" * 5000, 413, "the body is over 10^18 bytes, larger than the 3145728 bytes")])
def test_a_content_length_int_cannot_read_is_answered(
        webhook: Webhook, caplog: pytest.LogCaptureFixture, value: bytes, status: int,
        said: str) -> None:
    """'²' passes str.isdigit and int() refuses it, as it refuses over 4,300 digits: the
    handler raised, the peer got no answer and the log a traceback for every such request."""
    with _tls(webhook) as sock, caplog.at_level(logging.ERROR, logger=server.__name__):
        sock.sendall(b"POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Length: " + value +
                     b"\r\n\r\n")
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert (response.status, response.read().decode().startswith(said)) == (status, True)
    assert not caplog.records


def test_a_user_info_that_is_not_an_object_is_reviewed(
        webhook: Webhook, caplog: pytest.LogCaptureFixture) -> None:
    """The review's log line read userInfo.username outside the review's own error handling:
    the handler raised, the peer got no answer and the log a traceback."""
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "request": {**request(pod()), "userInfo": "alice"}}).encode()
    with caplog.at_level(logging.ERROR, logger=server.__name__):
        status, text = send(webhook, body)
    assert status == 200 and json.loads(text)["response"]["uid"] == "u-1"
    assert not caplog.records


def test_a_stuck_connection_makes_way_before_an_idle_keep_alive(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API server may be sending its next review on its keep-alive as that is closed, and
    does not retry a POST: a connection stuck on its peer goes first (the keep-alive went,
    and the stuck one stayed)."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 0.2)
    webhook.server.connections.limit = 2
    with _tls(webhook) as stuck, _tls(webhook) as api:
        assert _review_over(api) == 200
        _wait_for(lambda: sorted(_states(webhook)) == [server.IDLE, server.NEW])
        time.sleep(0.3)  # the stuck one is past PENDING_GRACE
        assert send(webhook, review(pod()))[0] == 200
        assert _closed_by_peer(stuck)
        assert _review_over(api) == 200


def test_a_request_waits_for_room_queue_wait_in_all(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its wait for the body's room and its wait for a review add up to QUEUE_WAIT, so its 503
    comes within the API server's timeout, which retries it (each waited QUEUE_WAIT: with
    the chart's, a 503 after 10 s, the webhook's timeout)."""
    monkeypatch.setattr(handler, "QUEUE_WAIT", 1.0)
    give_bodies, give_reviews = _hold("bodies", webhook), _hold("reviews", webhook)
    asked: list[float] = []
    acquire = webhook.server.reviews.acquire

    def recording(*args: Any, timeout: float = -1, **kwargs: Any) -> bool:
        asked.append(timeout)
        return acquire(*args, timeout=timeout, **kwargs)

    monkeypatch.setattr(webhook.server.reviews, "acquire", recording)
    timer = threading.Timer(0.6, give_bodies)
    timer.start()
    try:
        assert send(webhook, review(pod()), timeout=10)[0] == 503
    finally:
        timer.join()
        give_reviews()
    assert len(asked) == 1 and asked[0] < 0.6  # 1.0 - what it waited for the body (~0.6 s)


def test_a_request_head_that_dribbles_is_closed_after_head_timeout(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    """Places free or not: a peer sending a byte now and then held its connection (a thread)
    for as long as it liked, each read waiting up to IO_TIMEOUT."""
    monkeypatch.setattr(server, "HEAD_TIMEOUT", 0.5)
    with _tls(webhook) as dribbling, _tls(webhook) as silent:
        dribbling.sendall(b"POST /valid")
        assert _closed_by_peer(dribbling) and _closed_by_peer(silent)
    assert send(webhook, review(pod()))[0] == 200


def test_on_drain_a_request_head_that_does_not_come_holds_it_only_pending_grace(
        webhook: Webhook, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 0.3)
    with _tls(webhook) as sock:
        sock.sendall(b"POST /valid")
        _wait_for(lambda: _states(webhook) == [server.HEADERS])
        began = time.monotonic()
        assert webhook.server.drain(timeout=10) is True
        assert time.monotonic() - began < 5
        assert _closed_by_peer(sock)

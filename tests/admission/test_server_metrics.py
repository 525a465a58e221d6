"""The admission server's Prometheus metrics (kai_fractions/admission/metrics.py), against the
real server: each review it answers is counted by webhook and outcome and timed, each refusal
it answers instead by its reason, and its connections, body budget and drain are read live from
its own state at each scrape. The CLI serves them on --metrics-listen."""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from kai_fractions.admission import connections as connection_table
from kai_fractions.admission import handler, server
from kai_fractions.admission.config import AdmissionConfig
from kai_fractions.admission.metrics import OUTCOMES, REFUSALS, WEBHOOKS, AdmissionMetrics
from kai_fractions.admission.review import allow, deny
from kai_fractions.admission.server import WebhookServer
from kai_fractions.admission.tls import ReloadingContext
from tests.support.admission_metrics import FAMILIES, SENT, populated_admission_scrape
from tests.support.promql import exported, sample_value

from .conftest import GATE_IMAGE, Webhook, load
from .reviews import SM, pod
from .test_server_bounds import (
    _answer_status,
    _closed_by_peer,
    _hold,
    _in_thread,
    _review_over,
    _states,
    _tls,
    _wait_for,
    exchange,
    review,
    send,
)

REVIEWS = "kai_fractions_admission_reviews_total"
SECONDS = "kai_fractions_admission_review_seconds"
REFUSED = "kai_fractions_admission_requests_refused_total"


class Metered(Webhook):
    metrics: AdmissionMetrics

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def refusals(self) -> dict[str, float | None]:
        return {reason: self.value(REFUSED, reason=reason) for reason in REFUSALS}

    def reviews(self) -> dict[tuple[str, str], float | None]:
        return {(w, o): self.value(REVIEWS, webhook=w, outcome=o)
                for w in WEBHOOKS for o in OUTCOMES}


@pytest.fixture
def metered(tls_dir: Path) -> Iterator[Metered]:
    """The `webhook` fixture's server, given an AdmissionMetrics."""
    metrics = AdmissionMetrics()
    tls = ReloadingContext(str(tls_dir / "tls.crt"), str(tls_dir / "tls.key"))
    webhook_server = WebhookServer(("127.0.0.1", 0), AdmissionConfig(gate_image=GATE_IMAGE),
                                   tls, metrics)
    thread = threading.Thread(target=webhook_server.serve_forever,
                              kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    hook = Metered(webhook_server, tls_dir / "tls.crt")
    hook.metrics = metrics
    try:
        yield hook
    finally:
        webhook_server.shutdown()
        webhook_server.server_close()
        thread.join(timeout=5)


# -- reviews --------------------------------------------------------------------------------


def _raises(request: Mapping[str, Any], config: Any) -> Any:
    raise RuntimeError("a bug")


def test_every_series_is_there_at_zero_before_the_first_request(metered: Metered) -> None:
    """So that an alert over them sees a 0, not nothing."""
    assert set(metered.reviews().values()) == {0.0}
    assert set(metered.refusals().values()) == {0.0}
    for webhook in WEBHOOKS:
        assert metered.value(f"{SECONDS}_count", webhook=webhook) == 0.0


def test_reviews_are_counted_by_webhook_and_outcome_and_timed(
        metered: Metered, monkeypatch: pytest.MonkeyPatch) -> None:
    status, answer = metered.post("/validate", load("pod-plain.review.json"))
    assert status == 200 and answer["response"]["allowed"] is True
    status, answer = metered.post("/mutate", load("pod-invalid.review.json"))
    assert status == 200 and answer["response"]["allowed"] is False
    monkeypatch.setitem(server.ROUTES, "/validate", _raises)
    status, answer = metered.post("/validate", load("pod-plain.review.json"))
    assert status == 200 and answer["response"]["status"]["reason"] == "InternalError"
    assert metered.reviews() == {
        ("validate", "allowed"): 1.0, ("validate", "denied"): 0.0, ("validate", "error"): 1.0,
        ("mutate", "allowed"): 0.0, ("mutate", "denied"): 1.0, ("mutate", "error"): 0.0}
    assert set(metered.refusals().values()) == {0.0}  # a review is no refusal
    assert metered.value(f"{SECONDS}_count", webhook="validate") == 2.0
    assert metered.value(f"{SECONDS}_count", webhook="mutate") == 1.0
    assert metered.value(f"{SECONDS}_bucket", webhook="mutate", le="+Inf") == 1.0


def test_a_review_is_timed_from_its_body_to_its_decision(
        metered: Metered, monkeypatch: pytest.MonkeyPatch) -> None:
    """A review that takes 30 ms at least is observed above the 25 ms bucket."""

    def slow(request: Mapping[str, Any], config: Any) -> Any:
        time.sleep(0.03)
        return allow()

    monkeypatch.setitem(server.ROUTES, "/validate", slow)
    assert send(metered, review(pod()))[0] == 200
    assert metered.value(f"{SECONDS}_bucket", webhook="validate", le="0.025") == 0.0
    assert metered.value(f"{SECONDS}_bucket", webhook="validate", le="+Inf") == 1.0
    assert metered.value(f"{SECONDS}_sum", webhook="validate") >= 0.03


def _wrong_shape(field: str) -> bytes:
    """A fractional pod's review with `field` a number: `spec.volumes` (/validate raised on
    it), or its container's `env` (/mutate raised on it)."""
    obj = pod(SM)
    if field == "env":
        obj["spec"]["containers"][0]["env"] = 5
    else:
        obj["spec"]["volumes"] = 5
    return review(obj)


@pytest.mark.parametrize(("path", "field"), [("/validate", "volumes"), ("/mutate", "env"),
                                             ("/validate", "env"), ("/mutate", "volumes")])
def test_an_object_of_the_wrong_shape_is_denied_not_an_internal_error(
        metered: Metered, path: str, field: str) -> None:
    """Only a direct caller can send one (the API server decodes typed objects), and each
    internal error fires KaiFractionsAdmissionInternalErrors: a 400 denial naming the field."""
    status, answer = metered.post(path, _wrong_shape(field))
    where = "spec.containers[0].env" if field == "env" else "spec.volumes"
    assert status == 200 and answer["response"]["allowed"] is False
    assert answer["response"]["status"] == {
        "code": 400, "reason": "BadRequest", "message": f"{where}: must be a list, got int"}
    assert "patch" not in answer["response"]
    webhook = path[1:]
    assert metered.reviews() == {(w, o): float(w == webhook and o == "denied")
                                 for w in WEBHOOKS for o in OUTCOMES}


def test_a_review_whose_answer_finds_no_room_is_counted_with_its_outcome(
        metered: Metered, monkeypatch: pytest.MonkeyPatch) -> None:
    """It ran (and took its time, and may have been an internal error): counted in the reviews
    and timed, and its 503 as a no_room refusal too."""
    message = "x" * 50_000

    def wordy(request: Mapping[str, Any], config: Any) -> Any:
        return deny(message)

    monkeypatch.setitem(server.ROUTES, "/validate", wordy)
    body = review(pod())
    budget = metered.server.bodies
    held = budget.size - len(body) - 1000  # room for the body, not for the answer
    assert budget.take(held, timeout=0)
    try:
        status, _text, headers = exchange(metered, body)
    finally:
        budget.give(held)
    assert (status, headers["Retry-After"]) == (503, "1")
    assert metered.refusals() == {r: float(r == "no_room") for r in REFUSALS}
    assert metered.reviews() == {(w, o): float((w, o) == ("validate", "denied"))
                                 for w in WEBHOOKS for o in OUTCOMES}
    assert metered.value(f"{SECONDS}_count", webhook="validate") == 1.0


# -- refusals -------------------------------------------------------------------------------


def _raw(hook: Webhook, data: bytes) -> int:
    """`data` sent as is on a TLS connection; the answer's status."""
    with _tls(hook) as sock:
        sock.sendall(data)
        return _answer_status(sock)


def _short_body(hook: Webhook) -> int:
    """1,000 bytes announced, 10 sent, then the end of the stream: TLS's close_notify, after
    which the answer is still read (an SSLSocket cannot close only its sending side; a TCP
    half-close without close_notify ends the TLS session)."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context(cafile=str(hook.ca_file)).wrap_bio(
        incoming, outgoing, server_hostname="127.0.0.1")
    with socket.create_connection(("127.0.0.1", hook.port), timeout=10) as raw:

        def pumped(call: Callable[[], Any]) -> Any:
            while True:
                try:
                    return call()
                except ssl.SSLWantReadError:
                    raw.sendall(outgoing.read())
                    data = raw.recv(65536)
                    if not data:
                        raise ConnectionError("closed before its answer") from None
                    incoming.write(data)
                finally:
                    raw.sendall(outgoing.read())

        pumped(tls.do_handshake)
        tls.write(b"POST /validate HTTP/1.1\r\nHost: w\r\nContent-Length: 1000\r\n\r\n"
                  + b" " * 10)
        with contextlib.suppress(ssl.SSLWantReadError):
            tls.unwrap()  # sends close_notify; the server's comes after its answer
        raw.sendall(outgoing.read())
        answer = b""
        while b"\r\n" not in answer:
            answer += pumped(lambda: tls.read(65536))
    return int(answer.split(b" ", 2)[1])


def _no_room(hook: Webhook, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(handler, "QUEUE_WAIT", 0.2)
    give_back = _hold("reviews", hook)
    try:
        status, _text, headers = exchange(hook, review(pod()))
        assert headers["Retry-After"] == "1"
        return status
    finally:
        give_back()


def _not_found(hook: Webhook) -> int:
    statuses = [hook.post("/nope", load("pod-plain.review.json"))[0]]
    conn = hook.connect()
    try:
        conn.request("GET", "/metrics")  # the metrics are not served on the webhook's port
        statuses.append(conn.getresponse().status)
    finally:
        conn.close()
    assert statuses == [404, 404]
    return 404


def _body_timeout(hook: Webhook, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(handler, "BODY_GRACE", 0.3)
    return send(hook, b'{"apiVersion"', length=1000)[0]


REFUSALS_SENT: dict[str, tuple[int, int, Callable[[Webhook, pytest.MonkeyPatch], int]]] = {
    # reason -> (the status answered, how many, how)
    "body_too_large": (413, 1, lambda h, m: send(h, b"", length=server.MAX_BODY + 1)[0]),
    "body_timeout": (408, 1, _body_timeout),
    "body_short": (400, 1, lambda h, m: _short_body(h)),
    "length_required": (411, 1, lambda h, m: _raw(h, b"POST /validate HTTP/1.1\r\n\r\n")),
    "malformed": (400, 1, lambda h, m: h.post("/validate", b"{not json")[0]),
    "too_many_openings": (400, 1, lambda h, m: h.post("/mutate", b"[" * 200_001)[0]),
    "no_room": (503, 1, _no_room),
    "not_found": (404, 2, lambda h, m: _not_found(h)),
    "protocol": (501, 1, lambda h, m: _raw(h, b"BREW /validate HTTP/1.1\r\nHost: w\r\n\r\n")),
}


def test_every_refusal_reason_has_a_case() -> None:
    assert set(REFUSALS_SENT) == set(REFUSALS)


@pytest.mark.parametrize("reason", REFUSALS_SENT)
def test_each_refusal_is_counted_by_its_reason(metered: Metered, reason: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    status, times, how = REFUSALS_SENT[reason]
    assert how(metered, monkeypatch) == status
    assert metered.refusals() == {r: float(times if r == reason else 0) for r in REFUSALS}
    assert set(metered.reviews().values()) == {0.0}
    # the server goes on serving, and counting
    assert send(metered, review(pod()))[0] == 200
    assert metered.value(REVIEWS, webhook="validate", outcome="allowed") == 1.0


def test_no_room_for_a_body_is_counted_as_no_room(metered: Metered,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The other way to a 503: the body budget taken."""
    monkeypatch.setattr(handler, "QUEUE_WAIT", 0.2)
    give_back = _hold("bodies", metered)
    try:
        assert exchange(metered, review(pod()))[0] == 503
    finally:
        give_back()
    assert metered.value(REFUSED, reason="no_room") == 1.0


def test_a_body_whose_place_was_taken_is_no_refusal(metered: Metered,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that stalls past PENDING_GRACE makes way for a new connection: counted as an
    eviction, not as a body that ended short (the server ended its stream; nobody hears that
    answer)."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 0.2)
    monkeypatch.setattr(handler, "BODY_GRACE", 60.0)  # no 408 meanwhile
    metered.server.connections.limit = 1
    with _tls(metered) as stalled:
        stalled.sendall(b"POST /validate HTTP/1.1\r\nHost: w\r\nContent-Length: 3000000\r\n\r\n"
                        + b" " * 1000)
        _wait_for(lambda: _states(metered) == [server.READING])
        assert send(metered, review(pod()), timeout=30)[0] == 200
        assert _closed_by_peer(stalled)
    # its request has ended once what it held is back
    _wait_for(lambda: metered.server.bodies.free == metered.server.bodies.size)
    assert metered.value("kai_fractions_admission_connections_evicted_total") == 1.0
    assert set(metered.refusals().values()) == {0.0}
    assert metered.value(REVIEWS, webhook="validate", outcome="allowed") == 1.0


# -- connections, read live -----------------------------------------------------------------


def test_the_connection_limit_and_the_open_connections_are_read_at_each_scrape(
        metered: Metered, monkeypatch: pytest.MonkeyPatch) -> None:
    assert metered.value("kai_fractions_admission_connections_limit") == server.MAX_CONNECTIONS
    assert metered.value("kai_fractions_admission_connections_open") == 0.0
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 30.0)
    metered.server.connections.limit = 2
    assert metered.value("kai_fractions_admission_connections_limit") == 2.0
    first = [_tls(metered) for _ in range(2)]  # handshakes done, no request yet
    try:
        _wait_for(lambda: _states(metered) == [server.NEW] * 2)
        assert metered.value("kai_fractions_admission_connections_open") == 2.0
        # a third waits in the listen backlog: counted as the server counts it
        late, late_status = _in_thread(lambda: send(metered, review(pod()), timeout=20))
        _wait_for(lambda: metered.server.connections.waited >= 1)
        assert metered.value("kai_fractions_admission_connections_backlogged_total") >= 1
        assert metered.value("kai_fractions_admission_connections_evicted_total") == 0.0
        assert [_review_over(sock) for sock in first] == [200, 200]  # idle now: room
        late.join(timeout=20)
        assert late_status[0][0] == 200
        # the late one took the place of an idle keep-alive; nothing waits any more
        connections = metered.server.connections
        assert metered.value("kai_fractions_admission_connections_evicted_total") \
            == connections.evicted == 1
        assert metered.value("kai_fractions_admission_connections_backlogged_total") \
            == connections.waited >= 1
    finally:
        for sock in first:
            sock.close()
    _wait_for(lambda: len(metered.server.connections) == 0)
    assert metered.value("kai_fractions_admission_connections_open") == 0.0


def test_a_connection_waiting_in_the_backlog_is_counted_once(
        metered: Metered, monkeypatch: pytest.MonkeyPatch) -> None:
    """However many times the accepting thread looks again for a place (each ACCEPT_WAIT) while
    it waits: the counter's rate is connections per second. A second one that finds no place
    is a second."""
    monkeypatch.setattr(connection_table, "PENDING_GRACE", 30.0)
    monkeypatch.setattr(server, "ACCEPT_WAIT", 0.02)
    metered.server.connections.limit = 1
    backlogged = "kai_fractions_admission_connections_backlogged_total"
    for n in (1, 2):
        holder = _tls(metered)  # handshake done, no request yet: it keeps its place
        try:
            _wait_for(lambda: _states(metered) == [server.NEW])
            late, late_status = _in_thread(lambda: send(metered, review(pod()), timeout=20))
            _wait_for(lambda n=n: metered.server.connections.waited >= n)
            time.sleep(0.5)  # 25 ACCEPT_WAITs
            assert late.is_alive()
            assert metered.value(backlogged) == n
            assert _review_over(holder) == 200  # idle now: the late one takes its place
            late.join(timeout=20)
            assert late_status[0][0] == 200
        finally:
            holder.close()
        _wait_for(lambda: len(metered.server.connections) == 0)
    assert metered.value(backlogged) == 2.0


def test_the_body_bytes_held_and_the_drain_are_read_at_each_scrape(metered: Metered) -> None:
    budget = metered.server.bodies
    assert metered.value("kai_fractions_admission_body_bytes_budget") == server.BODY_BUDGET
    assert metered.value("kai_fractions_admission_body_bytes_held") == 0.0
    assert budget.take(12_345, timeout=0)
    try:
        assert metered.value("kai_fractions_admission_body_bytes_held") == 12_345.0
    finally:
        budget.give(12_345)
    assert metered.value("kai_fractions_admission_body_bytes_held") == 0.0
    assert metered.value("kai_fractions_admission_draining") == 0.0
    metered.server.draining = True
    assert metered.value("kai_fractions_admission_draining") == 1.0


def test_a_trickling_body_holds_its_bytes_in_the_gauge(
        metered: Metered, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a body holds while it arrives shows, and goes when it is answered."""
    monkeypatch.setattr(handler, "BODY_GRACE", 60.0)
    with _tls(metered) as sock:
        sock.sendall(b"POST /validate HTTP/1.1\r\nHost: w\r\nContent-Length: 5000\r\n\r\n"
                     + b" " * 1000)
        _wait_for(lambda: metered.value("kai_fractions_admission_body_bytes_held") == 1000.0)
        sock.sendall(b" " * 4000)
        assert _answer_status(sock) == 400  # whole, but no review
    _wait_for(lambda: metered.value("kai_fractions_admission_body_bytes_held") == 0.0)
    assert metered.value(REFUSED, reason="malformed") == 1.0


def test_without_metrics_the_server_counts_nothing_and_serves_as_before(
        webhook: Webhook) -> None:
    assert webhook.server.metrics is None
    assert send(webhook, review(pod()))[0] == 200
    assert send(webhook, b"", length=server.MAX_BODY + 1)[0] == 413


def test_one_scrape_has_every_family(metered: Metered) -> None:
    labels_of = exported(generate_latest(metered.metrics.registry).decode())
    assert set(FAMILIES) <= labels_of.keys()
    assert labels_of[REVIEWS] == {"webhook", "outcome"}
    assert labels_of[REFUSED] == {"reason"}


def test_the_docs_list_every_metric_and_every_reason(metered: Metered) -> None:
    """docs/admission.md, "Metrics": a row per family the server exports, the refusal reasons
    and the outcomes in theirs."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "admission.md").read_text()
    section = doc.split("### Metrics", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(kai_fractions_admission_\w+)[^`]*` \|[^|]*\| (.*) \|$", section,
                           flags=re.M))
    families = {f.name + "_total" if f.type == "counter" else f.name
                for f in metered.metrics.registry.collect()
                if f.name.startswith("kai_fractions_admission_")}
    assert set(rows) == families
    for reason in REFUSALS:
        assert f"`{reason}`" in rows[REFUSED], reason
    for outcome in OUTCOMES:
        assert f"`{outcome}`" in rows[REVIEWS], outcome


# -- the CLI --------------------------------------------------------------------------------


def test_the_cli_serves_its_metrics_on_metrics_listen(tls_dir: Path) -> None:
    """Over plain HTTP, and on while the replica drains (its reviews still counted): the
    process the chart's dashboard and alert tests scrape (tests/support/admission_metrics.py),
    which checked the counts of what it sent (SENT) in its first scrape."""
    text, draining = populated_admission_scrape(tls_dir)
    assert sample_value(text, REVIEWS, webhook="mutate", outcome="allowed") == 1.0
    assert sample_value(text, REVIEWS, webhook="validate", outcome="denied") == 1.0
    assert sample_value(text, REFUSED, reason="malformed") == 1.0
    assert sample_value(text, "kai_fractions_admission_connections_limit") == \
        server.MAX_CONNECTIONS
    assert sample_value(text, "kai_fractions_admission_draining") == 0.0
    assert sample_value(draining, "kai_fractions_admission_draining") == 1.0
    for (name, labels), value in SENT.items():
        assert sample_value(draining, name, **dict(labels)) == value, (name, labels)


def _admission(tls_dir: Path, *flags: str) -> list[str]:
    return ["admission", "--listen", "127.0.0.1:0", "--tls-cert", str(tls_dir / "tls.crt"),
            "--tls-key", str(tls_dir / "tls.key"), "--gate-image", GATE_IMAGE, *flags]


@pytest.mark.parametrize("address", ["nope", "127.0.0.1:99999", "127.0.0.1"])
def test_the_cli_refuses_a_metrics_address_that_is_not_one(tls_dir: Path, capsys,
                                                           address: str) -> None:
    from kai_fractions.cli import main

    assert main(_admission(tls_dir, "--metrics-listen", address)) == 2
    assert capsys.readouterr().err == (
        f"kai-fractions admission: --metrics-listen: expected HOST:PORT, got {address!r}\n")


def test_the_cli_refuses_a_metrics_port_it_cannot_bind(tls_dir: Path, capsys) -> None:
    from kai_fractions.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(_admission(tls_dir, "--metrics-listen", f"127.0.0.1:{port}")) == 2
    assert capsys.readouterr().err == (
        f"kai-fractions admission: --metrics-listen 127.0.0.1:{port}: Address already in use\n")


def test_a_request_line_the_server_cut_is_no_refusal(metered: Metered,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A request head cut after HEAD_TIMEOUT leaves a truncated request line, which the HTTP
    library answered 400 on the stream the server had ended, counted as `protocol`."""
    monkeypatch.setattr(server, "HEAD_TIMEOUT", 0.3)
    with _tls(metered) as sock:
        sock.sendall(b"POST /valid")
        assert _closed_by_peer(sock)
    _wait_for(lambda: len(metered.server.connections) == 0)
    time.sleep(0.2)  # the handler thread has read the cut line by now
    assert set(metered.refusals().values()) == {0.0}

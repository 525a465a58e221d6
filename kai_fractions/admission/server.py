"""HTTPS server for the webhooks: POST /validate, POST /mutate, GET /healthz.

Standard library only (ThreadingHTTPServer + ssl). The listening socket stays plain; each
accepted connection is wrapped with the context current at that moment (certificate reload),
and the TLS handshake runs in the connection's own thread with a timeout, so one slow client
cannot hold up the others.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .config import AdmissionConfig
from .mutate import mutate
from .review import Decision, ReviewError, deny, parse_review, response
from .tls import ReloadingContext
from .validate import validate

log = logging.getLogger(__name__)

MAX_BODY = 16 * 1024 * 1024
"""An AdmissionReview carries the object and the old object; etcd caps each near 1.5 MiB."""
HANDSHAKE_TIMEOUT = 10.0
IO_TIMEOUT = 30.0

Reviewer = Callable[[Mapping[str, Any], AdmissionConfig], Decision]
ROUTES: dict[str, Reviewer] = {"/validate": validate, "/mutate": mutate}


def parse_listen(address: str) -> tuple[str, int]:
    """`0.0.0.0:8443`, `[::]:8443` or `:8443` -> (host, port); raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen must be HOST:PORT, got {address!r}")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class WebhookServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], config: AdmissionConfig,
                 tls: ReloadingContext) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.config = config
        self.tls = tls
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        try:
            wrapped = self.tls.current().wrap_socket(
                sock, server_side=True, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError):
            sock.close()
            raise
        return wrapped, addr

    def finish_request(self, request: Any, client_address: Any) -> None:
        # Runs in the connection's thread: do the handshake here, bounded.
        try:
            request.settimeout(HANDSHAKE_TIMEOUT)
            request.do_handshake()
            request.settimeout(IO_TIMEOUT)
        except (OSError, ssl.SSLError) as e:
            log.debug("TLS handshake with %s failed: %s", client_address, e)
            return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.exception("error while serving %s", client_address)

    @property
    def port(self) -> int:
        return self.server_address[1]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the API server reuses connections
    server: WebhookServer
    server_version = "kai-fractions-admission"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_text(self, status: int, text: str) -> None:
        self._send(status, (text + "\n").encode(), "text/plain; charset=utf-8")

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] == "/healthz":
            self._send_text(HTTPStatus.OK, "ok")
        else:
            self._send_text(HTTPStatus.NOT_FOUND, f"no such path {self.path}; "
                            "GET /healthz, POST /validate or /mutate")

    def do_POST(self) -> None:
        route = ROUTES.get(self.path.split("?", 1)[0])
        if route is None:
            self._drain()
            self._send_text(HTTPStatus.NOT_FOUND, f"no such path {self.path}; "
                            "POST /validate or /mutate")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._send_text(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
            return
        if int(length) > MAX_BODY:
            self.close_connection = True
            self._send_text(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                            f"the body is larger than {MAX_BODY} bytes")
            return
        body = self.rfile.read(int(length))
        try:
            request = parse_review(body)
        except ReviewError as e:
            self._send_text(HTTPStatus.BAD_REQUEST, str(e))
            return
        try:
            decision = route(request, self.server.config)
        except Exception:
            # Never a stack trace to a user: the log has it, the caller gets a reason.
            log.exception("reviewing %s failed", request.get("uid"))
            decision = deny("kai-fractions admission: internal error while reviewing this "
                            "object; the webhook's log has the details", code=500,
                            reason="InternalError")
        log.info("%s %s %s/%s by %s: %s", self.path, request.get("operation"),
                 request.get("namespace") or "-", request.get("name") or "-",
                 (request.get("userInfo") or {}).get("username", "-"),
                 "allowed" + (f" with {len(decision.patch)} patch op(s)" if decision.patch
                              else "") if decision.allowed else f"denied: {decision.message}")
        payload = json.dumps(response(request["uid"], decision)).encode()
        self._send(HTTPStatus.OK, payload, "application/json")

    def _drain(self) -> None:
        length = self.headers.get("Content-Length")
        if length and length.isdigit() and int(length) <= MAX_BODY:
            self.rfile.read(int(length))
        else:
            self.close_connection = True


def make_server(listen: str, config: AdmissionConfig, tls: ReloadingContext) -> WebhookServer:
    return WebhookServer(parse_listen(listen), config, tls)

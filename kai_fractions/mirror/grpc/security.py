"""Transport security of the mirror: TLS / mutual TLS credentials, the bearer-token check, and
the rule that a plaintext server listens only on loopback or a unix socket.

The token check is a server interceptor, so every method (reflection included) is covered by
construction; only the standard health service is exempt, because kubelet's gRPC probes cannot
send metadata. Signatures of allocations belong to the write path, not here: see
`MirrorService(extra_annotations=...)`.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from .status import unauthenticated

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class SecurityConfigError(Exception):
    """A flag combination or file that cannot work; one line for the user (exit 2)."""


@dataclass(frozen=True, slots=True)
class ListenAddress:
    target: str
    """What gRPC binds: `host:port` or `unix:///abs/path.sock`."""

    @property
    def is_unix(self) -> bool:
        return self.target.startswith("unix:")

    @property
    def unix_path(self) -> str | None:
        if not self.is_unix:
            return None
        return self.target.removeprefix("unix://") if self.target.startswith("unix://") \
            else self.target.removeprefix("unix:")

    @property
    def host(self) -> str:
        host, _, _ = self.target.rpartition(":")
        return host.strip("[]")

    @property
    def is_local(self) -> bool:
        """A unix socket or a loopback host: reachable only from this machine (or pod)."""
        if self.is_unix:
            return True
        host = self.host
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False


def parse_listen(value: str) -> ListenAddress:
    if value.startswith("unix:"):
        path = ListenAddress(value).unix_path or ""
        if not path.startswith("/"):
            raise SecurityConfigError(f"--listen {value}: a unix socket needs an absolute "
                                      "path, e.g. unix:///run/kai-fractions/mirror.sock")
        return ListenAddress(f"unix://{path}")
    _, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise SecurityConfigError(f"--listen {value}: expected HOST:PORT (e.g. 127.0.0.1:50051, "
                                  "0.0.0.0:50051, [::1]:50051) or unix:///path.sock")
    return ListenAddress(value)


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"{flag} {path}: {e.strerror or e}") from None
    if not data.strip():
        raise SecurityConfigError(f"{flag} {path}: the file is empty")
    return data


def server_credentials(cert: str | None, key: str | None, client_ca: str | None
                       ) -> grpc.ServerCredentials | None:
    """None = plaintext. With a client CA, clients must present a certificate it signed."""
    if not cert and not key:
        if client_ca:
            raise SecurityConfigError("--tls-client-ca needs --tls-cert and --tls-key "
                                      "(mutual TLS is TLS plus client certificates)")
        return None
    if not cert or not key:
        raise SecurityConfigError("--tls-cert and --tls-key go together")
    pair = (_read(key, "--tls-key"), _read(cert, "--tls-cert"))
    roots = _read(client_ca, "--tls-client-ca") if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=roots,
                                       require_client_auth=roots is not None)


def check_plaintext(address: ListenAddress, tls: bool, insecure: bool) -> None:
    if not tls and not insecure and not address.is_local:
        raise SecurityConfigError(
            f"refusing to listen on {address.target} without TLS: pass --tls-cert and "
            "--tls-key, or --insecure to accept plaintext on a non-loopback address")


class TokenFile:
    """The expected bearer token, re-read when the file changes (rotation without restart)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._token = b""
        self._bad: tuple[int, int] | None = None
        """The file's stamp when it last could not be used (warned once)."""
        self.current()  # fail at start, not at the first call

    def current(self) -> bytes:
        try:
            st = os.stat(self.path)
        except OSError as e:
            if self._token:
                return self._token  # keep the last good token while a Secret is remounted
            raise SecurityConfigError(f"--token-file {self.path}: {e.strerror or e}") from None
        stamp = (st.st_mtime_ns, st.st_size)
        with self._lock:
            if stamp != self._stamp:
                try:
                    token = _read(self.path, "--token-file").strip()
                except SecurityConfigError as e:
                    if not self._token:
                        raise
                    # Emptied or unreadable while running: every call would fail otherwise.
                    if stamp != self._bad:
                        log.warning("%s; the token read last stays in use", e)
                        self._bad = stamp
                    return self._token
                self._token, self._stamp = token, stamp
            return self._token


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def abort(_request, context: grpc.aio.ServicerContext):
        await context.abort_with_status(unauthenticated(message))

    kinds: tuple[tuple[str, Callable], ...] = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    )
    for attribute, factory in kinds:
        if getattr(handler, attribute) is not None:
            return factory(abort, request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)
    raise AssertionError("a method handler of no known kind")


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <token>` on every call but health checks; anything else is
    UNAUTHENTICATED before the servicer runs, so nothing is read or written."""

    def __init__(self, token: TokenFile,
                 denied: Callable[[str], object] | None = None) -> None:
        self.token = token
        self.denied = denied
        """Told the method name of each call refused here (the metrics count them)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        values = [v for k, v in (handler_call_details.invocation_metadata or ())
                  if k == "authorization"]
        problem = ""
        if not values:
            problem = "missing `authorization: Bearer <token>` metadata"
        else:
            scheme, _, presented = str(values[0]).partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    presented.strip().encode(), self.token.current()):
                problem = "invalid bearer token"
        if not problem:
            return handler
        if self.denied is not None:
            self.denied(method.rpartition("/")[2])
        return _deny(handler, problem)

"""The mirror's gRPC server: AllocationMirror + standard health + reflection, TLS / mTLS /
bearer token, TCP or unix socket, graceful shutdown.

It is a grpc.aio server on an event loop of its own, in one thread ("mirror-loop"): every call
is a task on that loop, from the request's arrival through the pod's PATCH to the answer, with
no thread handoff on the way (handoffs between threads under one GIL were the threaded design's
largest cost: benchmarks/README.md). `start()` and `stop()` are plain blocking calls, so the
CLI, the demo and the tests drive it like any other server.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ...grpc_decode import add_service
from ..pod_feed import Feed
from ..service import MirrorService
from .security import (
    BearerTokenInterceptor,
    ListenAddress,
    SecurityConfigError,
    TokenFile,
    check_plaintext,
    parse_listen,
    server_credentials,
)
from .servicer import SERVICE, SERVICE_NAME, AllocationMirrorServicer, CallObserver

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_RECEIVE_MESSAGE_BYTES = 128 * 1024
"""The largest request the server reads (gRPC's default is 4 MiB). The largest VALID request
is 44,247 bytes: a MirrorAllocationRequest with every field at its bound, each string of the
widest characters its rule allows (a 63-character namespace; 253-character pod, node and
container names; a pod uid of 253 four-byte characters; a 64-character portion; 64 group ids
of 128 four-byte characters; 64 GPU UUIDs of 128 characters; a key of 256 four-byte
characters: `largest_request` in tests/mirror/test_bad_requests.py). 128 KiB is three times
that. A bigger request is RESOURCE_EXHAUSTED before it is parsed, rather than read and refused
field by field on the loop every call shares."""


@dataclass(frozen=True, slots=True)
class ServerOptions:
    listen: str = "127.0.0.1:50051"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    token_file: str | None = None
    insecure: bool = False
    grace_seconds: float = 10.0


class MirrorServer:
    """Build with the options (raises SecurityConfigError), then `start()`; `address` is what a
    client dials (the real port when the options asked for port 0). The service, and its
    store, run on this server's event loop and are closed there by `stop()`. `tasks` run on
    the same loop while it serves (the pod cache's feed), and are cancelled by `stop()`.
    `observe` is told of every call answered (the metrics')."""

    def __init__(self, service: MirrorService, options: ServerOptions,
                 tasks: Sequence[Feed] = (), observe: CallObserver | None = None) -> None:
        self.service = service
        self.options = options
        self.tasks = tuple(tasks)
        self.observe = observe
        self._running: list[asyncio.Task] = []
        self.listen, self.credentials, self._token = self.check(options)
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._stopped = False

    @staticmethod
    def check(options: ServerOptions
              ) -> tuple[ListenAddress, grpc.ServerCredentials | None, TokenFile | None]:
        """Validates the options (raises SecurityConfigError with a one-line reason)."""
        listen = parse_listen(options.listen)
        credentials = server_credentials(options.tls_cert, options.tls_key,
                                         options.tls_client_ca)
        if credentials is not None and options.tls_cert and options.tls_key:
            check_tls_files(options.tls_cert, options.tls_key, options.tls_client_ca)
        check_plaintext(listen, credentials is not None, options.insecure)
        token = TokenFile(options.token_file) if options.token_file else None
        return listen, credentials, token

    @property
    def address(self) -> str:
        if self.listen.is_unix:
            return self.listen.target
        host = self.listen.host
        host = "127.0.0.1" if host in ("", "0.0.0.0") else host
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self.port}"

    def start(self) -> MirrorServer:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="mirror-loop",
                                        daemon=True)
        self._thread.start()
        try:
            self._on_loop(self._start())
        except BaseException:
            self._on_loop(self._stop(0))
            self._end_loop()
            raise
        log.info("AllocationMirror listening on %s (%s%s)", self.address,
                 "mutual TLS" if self.options.tls_client_ca else
                 "TLS" if self.credentials else "plaintext",
                 ", bearer token required" if self.options.token_file else "")
        return self

    def stop(self, grace: float | None = None) -> None:
        """Health turns NOT_SERVING first (load balancers drain), in-flight calls get `grace`
        seconds to finish, new calls are refused; then the store's connections close."""
        if self._stopped or self._loop is None:
            return
        self._stopped = True
        self._on_loop(self._stop(self.options.grace_seconds if grace is None else grace))
        self._end_loop()
        log.info("AllocationMirror stopped")

    def __enter__(self) -> MirrorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=0)

    # -- on the loop ---------------------------------------------------------------------------

    def _on_loop(self, work: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def _end_loop(self) -> None:
        assert self._loop is not None and self._thread is not None
        self._on_loop(self._loop.shutdown_default_executor())  # asyncio.to_thread's, if any
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _start(self) -> None:
        observe = self.observe

        def denied(method: str) -> None:
            if observe is not None:
                observe(method, grpc.StatusCode.UNAUTHENTICATED.name, None)

        interceptors = [BearerTokenInterceptor(self._token, denied)] \
            if self._token is not None else []
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)])
        self._server = server
        # The servicer decodes, so that a request that does not decode is its refusal.
        add_service(server, AllocationMirrorServicer(self.service, self.observe), SERVICE)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        target = self.listen.target
        path = self.listen.unix_path
        if path:
            os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        try:
            if self.credentials is not None:
                self.port = server.add_secure_port(target, self.credentials)
            else:
                self.port = server.add_insecure_port(target)
        except RuntimeError as e:
            raise SecurityConfigError(f"cannot listen on {target}: {e}") from None
        if not path and not self.port:
            raise SecurityConfigError(f"cannot listen on {target}")
        await server.start()
        for task in self.tasks:
            name = getattr(task, "__qualname__", repr(task))  # a partial has no name
            self._running.append(asyncio.create_task(task(), name=name))
            self._running[-1].add_done_callback(_report_end)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def _stop(self, grace: float) -> None:
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        for task in self._running:  # after the last call: they may still use the cache
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        await self.service.close()


def check_tls_files(cert: str, key: str, client_ca: str | None) -> None:
    """Loads the pair (and the client CA) as the server will, so that what gRPC would refuse
    as it starts to listen (a key that is not the certificate's, a file that holds no PEM, an
    encrypted key) is refused at start, before the mirror writes anything to the cluster.
    It tests the pair, not a policy: OpenSSL's security level is 0 for the check, since
    Python's OpenSSL would otherwise refuse keys gRPC's BoringSSL serves (an RSA-1024 key at
    the usual level 2). Raises SecurityConfigError naming the flag and the reason."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_ciphers("ALL:@SECLEVEL=0")

    def no_password() -> bytes:
        raise SecurityConfigError(f"--tls-key {key}: an encrypted key; the mirror needs it "
                                  "unencrypted (PEM)")

    try:
        context.load_cert_chain(cert, key, password=no_password)
    except (OSError, ssl.SSLError) as e:
        raise SecurityConfigError(_pair_problem(cert, key, e)) from None
    if client_ca:
        try:
            context.load_verify_locations(cafile=client_ca)
        except (OSError, ssl.SSLError) as e:
            raise SecurityConfigError(f"--tls-client-ca {client_ca}: no CA certificate (PEM) "
                                      f"in it{_reason(e)}") from None


def _pair_problem(cert: str, key: str, error: OSError | ssl.SSLError) -> str:
    """Which of the two files is at fault, as one line: a file is named as holding no PEM only
    when it does not parse; any other refusal is OpenSSL's, as it gave it."""
    if isinstance(error, ssl.SSLError) and error.reason == "KEY_VALUES_MISMATCH":
        return f"--tls-key {key}: not the private key of --tls-cert {cert} (key values mismatch)"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert)
    except (OSError, ssl.SSLError):
        return f"--tls-cert {cert}: no certificate (PEM) in it{_reason(error)}"
    if not _holds_private_key(key):
        return f"--tls-key {key}: no private key (PEM) in it{_reason(error)}"
    return (f"--tls-cert {cert} with --tls-key {key}: refused by OpenSSL"
            f"{_reason(error) or f' ({error})'}")


def _holds_private_key(path: str) -> bool:
    """Whether `path` holds a PEM private key, of any type (`cryptography` parses it)."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    try:
        with open(path, "rb") as f:
            serialization.load_pem_private_key(f.read(), password=None)
    except (OSError, ValueError):
        return False
    except (TypeError, UnsupportedAlgorithm):  # encrypted, or of a type it does not know
        return True
    return True


def _reason(error: OSError | ssl.SSLError) -> str:
    """` (OpenSSL's reason)`, e.g. ` (no certificate or crl found)`; "" when it gave none (its
    text, `[SSL] PEM lib (_ssl.c:3905)`, would say nothing more)."""
    if isinstance(error, ssl.SSLError):
        return f" ({error.reason.lower().replace('_', ' ')})" if error.reason else ""
    return f" ({error.strerror or error})"


def _report_end(task: asyncio.Task) -> None:
    """A task meant to run until cancelled ended on its own: say why. The server goes on; a
    pod cache that lost its feed still learns from the mirror's reads and writes, and what it
    holds is never trusted (pod_cache), so a stale entry costs a refused write, not a wrong
    answer."""
    if not task.cancelled():
        log.error("background task %s ended: %r", task.get_name(), task.exception())

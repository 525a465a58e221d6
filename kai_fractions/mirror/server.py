"""The mirror's gRPC server: AllocationMirror + standard health + reflection, TLS / mTLS /
bearer token, TCP or unix socket, graceful shutdown."""

from __future__ import annotations

import logging
import os
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..api.v1 import allocation_pb2_grpc as pb_grpc
from .security import (
    BearerTokenInterceptor,
    ListenAddress,
    SecurityConfigError,
    TokenFile,
    check_plaintext,
    parse_listen,
    server_credentials,
)
from .service import MirrorService
from .servicer import SERVICE_NAME, AllocationMirrorServicer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerOptions:
    listen: str = "127.0.0.1:50051"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    token_file: str | None = None
    insecure: bool = False
    max_workers: int = 16
    grace_seconds: float = 10.0


class MirrorServer:
    """Build with the options (raises SecurityConfigError), then `start()`; `address` is what a
    client dials (the real port when the options asked for port 0)."""

    def __init__(self, service: MirrorService, options: ServerOptions) -> None:
        self.options = options
        self.listen, self.credentials, token = self.check(options)
        interceptors = [BearerTokenInterceptor(token)] if token is not None else []
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=options.max_workers,
                                       thread_name_prefix="mirror-rpc"),
            interceptors=interceptors)
        pb_grpc.add_AllocationMirrorServicer_to_server(AllocationMirrorServicer(service),
                                                       self.server)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.port = 0
        self._stopped = threading.Event()

    @staticmethod
    def check(options: ServerOptions
              ) -> tuple[ListenAddress, grpc.ServerCredentials | None, TokenFile | None]:
        """Validates the options (raises SecurityConfigError with a one-line reason)."""
        listen = parse_listen(options.listen)
        credentials = server_credentials(options.tls_cert, options.tls_key,
                                         options.tls_client_ca)
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
        target = self.listen.target
        path = self.listen.unix_path
        if path:
            os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        try:
            if self.credentials is not None:
                self.port = self.server.add_secure_port(target, self.credentials)
            else:
                self.port = self.server.add_insecure_port(target)
        except RuntimeError as e:
            raise SecurityConfigError(f"cannot listen on {target}: {e}") from None
        if not path and not self.port:
            raise SecurityConfigError(f"cannot listen on {target}")
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("AllocationMirror listening on %s (%s%s)", self.address,
                 "mutual TLS" if self.options.tls_client_ca else
                 "TLS" if self.credentials else "plaintext",
                 ", bearer token required" if self.options.token_file else "")
        return self

    def stop(self, grace: float | None = None) -> None:
        """Health turns NOT_SERVING first (load balancers drain), in-flight calls get `grace`
        seconds to finish, new calls are refused."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(self.options.grace_seconds if grace is None else grace).wait()
        log.info("AllocationMirror stopped")

    def wait(self, timeout: float | None = None) -> bool:
        return self.server.wait_for_termination(timeout)

    def __enter__(self) -> MirrorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=0)

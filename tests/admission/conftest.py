"""Fixtures for the admission tests: a real HTTPS webhook server on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kai_fractions.admission.config import AdmissionConfig
from kai_fractions.admission.server import WebhookServer
from kai_fractions.admission.tls import ReloadingContext

from .certs import install, make_cert

DATA = Path(__file__).parent / "data"
GATE_IMAGE = "registry.example.com/kai-fractions:0.1.0"


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


@dataclass
class Webhook:
    server: WebhookServer
    ca_file: Path

    @property
    def port(self) -> int:
        return self.server.port

    def connect(self, ca_file: Path | None = None) -> http.client.HTTPSConnection:
        ctx = ssl.create_default_context(cafile=str(ca_file or self.ca_file))
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=ctx, timeout=10)

    def post(self, path: str, body: bytes | dict) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = self.connect()
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        is_json = resp.getheader("Content-Type", "").startswith("application/json")
        return resp.status, json.loads(raw) if is_json else raw.decode()


@pytest.fixture
def tls_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "tls"
    directory.mkdir()
    install(directory, *make_cert("webhook-a"))
    return directory


@pytest.fixture
def webhook(tls_dir: Path) -> Iterator[Webhook]:
    config = AdmissionConfig(gate_image=GATE_IMAGE)
    tls = ReloadingContext(str(tls_dir / "tls.crt"), str(tls_dir / "tls.key"))
    server = WebhookServer(("127.0.0.1", 0), config, tls)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield Webhook(server, tls_dir / "tls.crt")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

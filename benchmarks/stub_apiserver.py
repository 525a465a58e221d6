"""A Kubernetes API stand-in for the benchmarks: pods and nodes answered from memory at
near-zero cost, in its own process (`python -m benchmarks.stub_apiserver`).

kmock is far too slow to be a baseline (milliseconds per request); this answers in tens of
microseconds, so what a benchmark measures is the client, not the server. It speaks just
enough HTTP/1.1 (keep-alive, Content-Length bodies) and just enough of the API for the official
`kubernetes` client and the mirror's KubePodStore:

* ``GET /api/v1/namespaces/{ns}/pods/{name}``: any pod name exists. A pod seen for the first
  time is made from the template (``--pod-template FILE``, a Pod's JSON) with its name,
  namespace, ``uid`` = :func:`pod_uid` and ``resourceVersion`` "1", so every call of a
  benchmark can use a pod of its own without creating it first.
* ``PATCH`` of the same path with a JSON merge patch (RFC 7386): a ``metadata.uid`` or
  ``metadata.resourceVersion`` in the patch that differs from the stored one is a 409 Conflict
  and changes nothing, as on a real API server; otherwise the patch is applied, the
  resourceVersion (one server-wide counter) moves on and the pod is answered.
* ``GET /api/v1/nodes/{name}``: a node carrying ``nvidia.com/gpu.memory`` = ``--node-memory-mib``.
* ``GET /stats``: ``{"requests": N, "pods": M, "pid": P}`` (API requests so far; not counted).

Binds 127.0.0.1 only. Prints ``PORT <n>`` on stdout when it is listening.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from kai_fractions.contract import keys as k

_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/?]+)")
_NODE = re.compile(r"^/api/v1/nodes/([^/?]+)")
_UID_NAMESPACE = uuid.UUID("6ba7b811-9dad-11d1-80b4-00c04fd430c8")  # RFC 4122 URL namespace


def pod_uid(namespace: str, name: str) -> str:
    """The uid the stub gives pod `namespace/name` (a client computes it the same way)."""
    return str(uuid.uuid5(_UID_NAMESPACE, f"{namespace}/{name}"))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def status_response(code: int, reason: str, message: str) -> tuple[int, dict]:
    return code, {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                  "message": message, "reason": reason, "code": code}


class Cluster:
    def __init__(self, pod_template: dict, node_memory_mib: int) -> None:
        self.template = json.dumps(pod_template)  # json.loads copies faster than deepcopy
        self.node_memory_mib = node_memory_mib
        self.pods: dict[tuple[str, str], dict] = {}
        self.revision = 1
        self.requests = 0

    def pod(self, namespace: str, name: str) -> dict:
        key = (namespace, name)
        pod = self.pods.get(key)
        if pod is None:
            pod = json.loads(self.template)
            meta = pod.setdefault("metadata", {})
            meta.update(name=name, namespace=namespace, uid=pod_uid(namespace, name),
                        resourceVersion="1")
            self.pods[key] = pod
        return pod

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        if path == "/stats":  # not an API request: not counted
            return 200, {"requests": self.requests, "pods": len(self.pods), "pid": os.getpid()}
        self.requests += 1
        if (m := _POD.match(path)) is not None:
            pod = self.pod(m.group(1), m.group(2))
            if method == "GET":
                return 200, pod
            if method == "PATCH":
                return self.patch(pod, body)
            return status_response(405, "MethodNotAllowed", f"{method} is not served by the stub")
        if (m := _NODE.match(path)) is not None and method == "GET":
            return 200, {"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": m.group(1), "uid": pod_uid("", m.group(1)), "resourceVersion": "1",
                "labels": {k.NODE_GPU_MEMORY_LABEL: str(self.node_memory_mib)}}}
        return status_response(404, "NotFound", f"{method} {path} is not served by the stub")

    def patch(self, pod: dict, body: bytes) -> tuple[int, dict]:
        try:
            patch = json.loads(body)
        except ValueError as e:
            return status_response(400, "BadRequest", f"not JSON: {e}")
        meta = pod["metadata"]
        want = patch.get("metadata") or {}
        for field in ("uid", "resourceVersion"):
            if field in want and want[field] != meta[field]:
                return status_response(409, "Conflict", f'Operation cannot be fulfilled on pods '
                               f'"{meta["name"]}": precondition {field} {want[field]} != '
                               f'{meta[field]}')
        patched = merge_patch(pod, patch)
        self.revision += 1
        patched["metadata"]["resourceVersion"] = str(self.revision)
        pod.clear()
        pod.update(patched)
        return 200, pod


_REASON = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           409: "Conflict"}


class _Http(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and Content-Length bodies: all the official client sends.
    A Protocol rather than streams: a third of the cost per request."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].decode("latin-1")
            lines = head.split("\r\n")
            length, close = 0, False
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and value.strip().lower() == "close":
                    close = True
            if len(self.buffer) < end + 4 + length:
                return  # the body is still on its way
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            method, target, _ = lines[0].split(" ", 2)
            code, obj = self.cluster.answer(method, target.split("?", 1)[0], body)
            payload = json.dumps(obj, separators=(",", ":")).encode()
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (
                                     code, _REASON.get(code, "").encode(), len(payload),
                                     payload))
            if close:
                self.transport.close()
                return


async def _main(port: int, cluster: Cluster) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Http(cluster), "127.0.0.1", port, backlog=256)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stub_apiserver",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--pod-template", metavar="FILE", help="a Pod as JSON")
    parser.add_argument("--node-memory-mib", type=int, default=81920)
    args = parser.parse_args(argv)
    template = {"apiVersion": "v1", "kind": "Pod", "metadata": {},
                "spec": {"containers": [{"name": "main"}]}}
    if args.pod_template:
        with open(args.pod_template) as f:
            template = json.load(f)
    with suppress(KeyboardInterrupt):
        asyncio.run(_main(args.port, Cluster(template, args.node_memory_mib)))
    return 0


REPO = Path(__file__).resolve().parent.parent


def read_port(process: subprocess.Popen, what: str) -> int:
    """The `PORT <n>` line a helper process prints once it listens."""
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line.startswith("PORT "):
        process.kill()
        raise RuntimeError(f"{what} did not start (said {line!r}); see its stderr")
    return int(line.split()[1])


@contextmanager
def running(pod_template: dict, node_memory_mib: int = 81920) -> Iterator[str]:
    """Starts the stub in its own process; yields its base URL; stops it."""
    with tempfile.TemporaryDirectory(prefix="kf-stub-") as tmp:
        template = Path(tmp) / "pod.json"
        template.write_text(json.dumps(pod_template))
        process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.stub_apiserver", "--pod-template", str(template),
             "--node-memory-mib", str(node_memory_mib)],
            cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            yield f"http://127.0.0.1:{read_port(process, 'the stub API server')}"
        finally:
            process.terminate()
            process.wait(10)


def kubeconfig(url: str, path: Path) -> Path:
    """A kubeconfig (JSON is valid YAML) that points the official client at `url`."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "stub",
        "clusters": [{"name": "stub", "cluster": {"server": url}}],
        "users": [{"name": "stub", "user": {}}],
        "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
    }))
    return path


if __name__ == "__main__":
    sys.exit(main())

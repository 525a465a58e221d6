"""P6's baseline: a cache of Pending pods as a user of aiohttp would write it, with no code of
this project (`python -m benchmarks.bare_cache KUBECONFIG`, a process of its own).

One `aiohttp.ClientSession`, the URL and credentials from the kubeconfig through the official
client's Configuration (as P1's (b)), a list of Pending pods in pages of the mirror's size,
each pod kept in a dict as the fields the mirror's cache keeps (metadata name, namespace, uid,
resourceVersion, annotations and labels; each container's name and resources; nodeName), as
JSON decoding made them: no sharing, no interning. Prints one JSON line: the pods kept and the
RSS they grew (after a first request, so the client's own start-up is not counted).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time
from typing import Any

import aiohttp

from kai_fractions.kube.config import auth_headers, endpoint, load_api_client
from kai_fractions.mirror.pod_feed import LIST_PAGE_SIZE, pod_selector

PODS = "/api/v1/pods"
EMPTY = "/api/v1/namespaces/kf-bare-cache-none/pods"
_METADATA = ("name", "namespace", "uid", "resourceVersion", "annotations", "labels")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def kept(pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    containers = [{k: c[k] for k in ("name", "resources") if k in c}
                  for c in spec.get("containers") or []]
    node = {"nodeName": spec["nodeName"]} if "nodeName" in spec else {}
    return {k: meta[k] for k in _METADATA if k in meta}, {"containers": containers, **node}


async def measure(kubeconfig: str) -> dict[str, float]:
    api = load_api_client(kubeconfig)
    base = endpoint(api.configuration).base_url
    cache: dict[tuple[str, str], Any] = {}
    async with aiohttp.ClientSession() as session:

        async def get(path: str, query: dict[str, str]) -> dict[str, Any]:
            async with session.get(base + path, params=query,
                                   headers=auth_headers(api, "GET", path, None)) as response:
                response.raise_for_status()
                return json.loads(await response.read())

        await get(EMPTY, {})  # the client's first request, before RSS is read
        gc.collect()
        before = rss_bytes()
        token = ""
        while True:
            query = {"limit": str(LIST_PAGE_SIZE), "fieldSelector": pod_selector()}
            if token:
                query["continue"] = token
            page = await get(PODS, query)
            for pod in page.get("items") or []:
                metadata, spec = kept(pod)
                cache[(metadata.get("namespace"), metadata.get("name"))] = (metadata, spec)
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                break
        gc.collect()
        time.sleep(0.5)  # as bench_pending waits before it reads a mirror's RSS
        return {"pods": len(cache), "rss_growth": rss_bytes() - before}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.bare_cache KUBECONFIG", file=sys.stderr)
        return 2
    print(json.dumps(asyncio.run(measure(args[0]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

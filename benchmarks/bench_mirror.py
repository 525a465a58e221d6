"""P1 mirror overhead: what `MirrorAllocation` costs beyond what a user would write without us,
with the same libraries: a grpc.aio server and a pod PATCH made with aiohttp. Besides this
process: the stub API server (`benchmarks.stub_apiserver`), two echo servers and the mirror,
measured side by side in one run:

(a2) gRPC echo: `benchmarks.grpc_echo`, a grpc.aio server that answers the same method with a
     canned response: the floor of any gRPC call the mirror's way.
(b)  the bare guarded pod PATCH, made with the library the mirror uses (aiohttp) directly: one
     `aiohttp.ClientSession`, the URL and credentials from the kubeconfig through the official
     client's Configuration, a JSON merge patch of the annotations the mirror writes carrying
     `metadata.uid`. Not guarded by resourceVersion: the stub makes the pod on first use, at a
     resourceVersion of its own that only a read (or a watch) would tell. At c=16, 16
     coroutines on one event loop.
(b2) the same, a bare GET + PATCH guarded by uid and the resourceVersion read (two round
     trips): what a user without a cache of pods writes.
(d2) a2's server making (b)'s PATCH in its handler through the mirror's own store
     (`KubePodStore(Kube(...))`): the floor of the mirror's design, with none of its own work
     (contract, cache, records, logging).
(d3) the same server making (b)'s own PATCH in its handler: no code of this project in the
     call's path, only the two libraries composed in one process on one loop (as a service
     must: it answers the call after the write), the floor of any design built on them.
     d3/(a2+b) says what the composition alone costs, against the c=1 target.
(c)  `MirrorAllocation` end to end: the real `kai-fractions mirror` process, configured by a
     kubeconfig that points at the stub, called by a real gRPC client.

Dropped when the mirror moved to `kai_fractions.kube` (aiohttp): (a), a thread-pool echo
server, and (d), that server making the official client's PATCH in its handler threads. The
mirror is one event loop over aiohttp; a threaded server over aiohttp (a loop per thread) is
not what anyone would write, and the official client is no longer the library compared.

Every call uses a pod of its own, so every call writes. Concurrency 1 is one blocking client
(latency); concurrency 16 is 16 calls in flight (gRPC: one asyncio channel; aiohttp: 16
coroutines on one loop), throughput. Ratios: c / (a2 + b) from p50 latencies at c=1, from time
per call (1 / throughput) at c=16. Targets: c/(a2+b) <= 1.2 at c=1; at c=16, >= 800 allocations
per second and p99 < 25 ms. `python -m benchmarks.bench_mirror --profile` profiles the mirror's
own path in-process instead (cProfile, top functions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import aiohttp
import grpc

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.api.v1 import allocation_pb2_grpc as pb_grpc
from kai_fractions.contract import keys as k
from kai_fractions.kube.config import auth_headers, endpoint, load_api_client

from .harness import Result, percentile
from .stub_apiserver import REPO, kubeconfig, pod_uid, read_port, running, seed

GPU = "GPU-3f2a9c1e-7b4d-4e8a-b6c5-1d2e3f4a5b6c"
CONTAINER = "main"
NODE_MEMORY_MIB = 81920
CONCURRENCY = 16
CALL_TIMEOUT_S = 5.0
ROUNDS = 16
"""Every kind is measured in this many short rounds, in turn: a slow stretch of this shared
machine (seconds long) then lands on every kind alike instead of on one kind's long block."""
POD_TEMPLATE = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"labels": {"app": "bench"}, "annotations": {
        k.GPU_FRACTION: "0.5",
        k.DEFAULT_KEYS.container(CONTAINER, k.COMPUTE_MODE): "sm-sharing",
        "team": "bench"}},
    "spec": {"schedulerName": k.KAI_SCHEDULER_NAME,
             "containers": [{"name": CONTAINER, "image": "registry.invalid/train:1"},
                            {"name": "sidecar", "image": "registry.invalid/log:1"}]},
}
"""An sm-sharing fraction: the case that writes the most keys (MPS pipe dir and percentage)."""


def request(namespace: str, name: str) -> pb.MirrorAllocationRequest:
    """What a scheduler sends for pod `namespace/name` (the node's memory given, no node read)."""
    return pb.MirrorAllocationRequest(allocation=pb.Allocation(
        pod=pb.PodRef(namespace=namespace, name=name, uid=pod_uid(namespace, name)),
        selected_node="gpu-node-1",
        received_resource_type=pb.RECEIVED_RESOURCE_TYPE_FRACTION,
        received_gpu=pb.ReceivedGpu(count=1, portion="0.5"),
        selected_fractional_gpu_groups=[pb.FractionalGpuGroup(
            id="group-0", compute_sharing_mode=pb.COMPUTE_SHARING_MODE_SM_SHARING)],
        reserved_gpu_ids=[GPU], node_gpu_memory_mib=NODE_MEMORY_MIB, reserve_mib=0),
        idempotency_key=f"bench/{name}")


# -- processes --------------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(address: str, what: str, process: subprocess.Popen, log: Path | None = None,
                timeout: float = 30.0) -> None:
    """Until `address` accepts gRPC; fails fast (with the log's tail) if the process dies."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        ready = grpc.channel_ready_future(channel)
        while time.monotonic() < deadline:
            try:
                ready.result(timeout=0.2)
                return
            except grpc.FutureTimeoutError:
                if process.poll() is not None:
                    tail = log.read_text()[-2000:] if log is not None else ""
                    raise RuntimeError(f"{what} exited ({process.returncode}) before it "
                                       f"listened on {address}:\n{tail}") from None
    raise RuntimeError(f"{what} did not listen on {address} within {timeout} s")


_MIRROR_MAIN = """
import argparse, sys
from kai_fractions.cli import mirror
parser = argparse.ArgumentParser()
mirror.register(parser.add_subparsers())
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""
"""`kai-fractions mirror`, its own parser and run() (the other commands stay out of its way)."""


@contextmanager
def mirror_process(kubeconfig_path: Path, log_path: Path, main: str = _MIRROR_MAIN,
                   flags: tuple[str, ...] = (), cwd: Path = REPO) -> Iterator[tuple[str, int]]:
    """`kai-fractions mirror` as deployed (default flags, info logging; `flags` added);
    yields (address, pid). `main` is the Python that starts it; it imports kai_fractions from
    `cwd` (first on `python -c`'s path), so another checkout's mirror runs from its own tree."""
    address = f"127.0.0.1:{_free_port()}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", main, "mirror", "--listen", address,
             "--kubeconfig", str(kubeconfig_path), *flags],
            cwd=cwd, stdout=subprocess.DEVNULL, stderr=log)
        try:
            _wait_ready(address, "the mirror", process, log_path)
            _wait_quiet(process.pid, "the mirror")
            yield address, process.pid
        finally:
            process.terminate()
            process.wait(15)


@contextmanager
def echo_process(response: bytes, directory: Path, patch_kubeconfig: Path | None = None,
                 patch_annotations: dict[str, str] | None = None, bare: bool = False
                 ) -> Iterator[str]:
    """The aio gRPC echo server (a2); with `patch_kubeconfig`, one that also makes the pod's
    PATCH through the mirror's store (d2), or with `bare` as (b) makes it (d3)."""
    directory.mkdir(exist_ok=True)
    path = directory / "response.bin"
    path.write_bytes(response)
    argv = [sys.executable, "-m", "benchmarks.grpc_echo", "--response", str(path)]
    if patch_kubeconfig is not None:
        annotations = directory / "annotations.json"
        annotations.write_text(json.dumps(patch_annotations or {}))
        argv += ["--patch-kubeconfig", str(patch_kubeconfig), "--patch-annotations",
                 str(annotations)] + (["--bare"] if bare else [])
    process = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        address = f"127.0.0.1:{read_port(process, 'the gRPC echo server')}"
        _wait_ready(address, "the gRPC echo server", process)
        yield address
    finally:
        process.terminate()
        process.wait(10)


def _wait_quiet(pid: int, what: str, timeout: float = 120.0) -> None:
    """Until the process has used (almost) no CPU for half a second: a mirror's first list of
    the seeded pods is merged. The cache's work yields to calls, so a list still going on when
    the calls start would run through their measurement, slowly, and be counted as theirs."""
    deadline = time.monotonic() + timeout
    quiet = 0
    before = cpu_seconds(pid)
    while quiet < 5:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not go quiet within {timeout} s")
        time.sleep(0.1)
        now = cpu_seconds(pid)
        quiet = quiet + 1 if now - before <= 0.01 else 0
        before = now


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- load generators --------------------------------------------------------------------------

class Names:
    """Fresh pod names, so every call writes a pod nobody wrote before."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._next = 0
        self._lock = threading.Lock()

    def take(self, count: int) -> list[str]:
        with self._lock:
            start, self._next = self._next, self._next + count
        return [f"p{i}" for i in range(start, start + count)]


def serial(call: Callable[[str], object], names: list[str]) -> tuple[list[float], float]:
    """Latencies (s) of back-to-back calls, and the wall time of them all."""
    out = []
    begin = time.perf_counter()
    for name in names:
        start = time.perf_counter()
        call(name)
        out.append(time.perf_counter() - start)
    return out, time.perf_counter() - begin


def grpc_concurrent(address: str, namespace: str, names: list[str], workers: int
                    ) -> tuple[list[float], float]:
    """`workers` MirrorAllocation calls in flight over one asyncio channel."""
    requests = [request(namespace, n) for n in names]

    async def main() -> tuple[list[float], float]:
        out: list[float] = []
        pending = iter(requests)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.AllocationMirrorStub(channel)

            async def worker() -> None:
                for req in pending:
                    start = time.perf_counter()
                    await stub.MirrorAllocation(req, timeout=CALL_TIMEOUT_S)
                    out.append(time.perf_counter() - start)

            begin = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(workers)))
            return out, time.perf_counter() - begin

    return asyncio.run(main())


def grpc_serial(address: str, namespace: str, names: list[str]) -> tuple[list[float], float]:
    requests = {n: request(namespace, n) for n in names}
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.AllocationMirrorStub(channel)
        stub.MirrorAllocation(request(namespace, "warm-channel"), timeout=CALL_TIMEOUT_S)
        return serial(lambda n: stub.MirrorAllocation(requests[n], timeout=CALL_TIMEOUT_S),
                      names)


MERGE_PATCH = "application/merge-patch+json"


class BarePatch:
    """The one write the mirror makes, done directly with aiohttp, as a user of that library
    would: one `ClientSession` on an event loop of this object's own, the server's URL and the
    credentials from the kubeconfig through the official client's Configuration (read for
    every request, as the official client does, so a rotated token would be picked up), a JSON
    merge patch of the annotations carrying the pod's uid; with `read_first`, a GET first and
    its resourceVersion in the patch too."""

    def __init__(self, kubeconfig_path: Path, annotations: dict[str, str],
                 read_first: bool) -> None:
        self.api = load_api_client(str(kubeconfig_path))
        self.base_url = endpoint(self.api.configuration).base_url
        self.annotations = annotations
        self.read_first = read_first
        self.timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        self.loop: asyncio.AbstractEventLoop | None = None  # measure's; (d3) awaits on its own
        self.session: aiohttp.ClientSession | None = None

    async def patch(self, namespace: str, name: str) -> dict:
        if self.session is None:  # made on the loop that uses it
            self.session = aiohttp.ClientSession()
        path = f"/api/v1/namespaces/{namespace}/pods/{name}"
        metadata = {"annotations": self.annotations, "uid": pod_uid(namespace, name)}
        if self.read_first:
            async with self.session.get(self.base_url + path, timeout=self.timeout,
                                        headers=auth_headers(self.api, "GET", path, None)
                                        ) as response:
                response.raise_for_status()
                metadata["resourceVersion"] = json.loads(await response.read())[
                    "metadata"]["resourceVersion"]
        body = json.dumps({"metadata": metadata}).encode()
        headers = auth_headers(self.api, "PATCH", path, body)
        headers["Content-Type"] = MERGE_PATCH
        async with self.session.patch(self.base_url + path, data=body, headers=headers,
                                      timeout=self.timeout) as response:
            response.raise_for_status()
            return json.loads(await response.read())

    def measure(self, namespace: str, names: list[str], concurrency: int
                ) -> tuple[list[float], float]:
        """Latencies of PATCHes of `names` made by `concurrency` coroutines at once on the
        loop (1: one after the other), and the wall time of them all."""

        async def main() -> tuple[list[float], float]:
            out: list[float] = []
            pending = iter(names)

            async def worker() -> None:
                for name in pending:
                    start = time.perf_counter()
                    await self.patch(namespace, name)
                    out.append(time.perf_counter() - start)

            begin = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return out, time.perf_counter() - begin

        if self.loop is None:
            self.loop = asyncio.new_event_loop()
        return self.loop.run_until_complete(main())

    def close(self) -> None:
        if self.loop is not None:
            if self.session is not None:
                self.loop.run_until_complete(self.session.close())
            self.loop.close()
        self.api.close()


# -- the benchmark ----------------------------------------------------------------------------

TARGET_RATIO_C1 = "<= 1.2"
"""c / (a2 + b) at c=1, from p50 latencies."""
TARGET_RATE_C16 = ">= 800"
"""Allocations per second at c=16 (on the 2 CPUs of the machine the figures are taken on)."""
TARGET_P99_C16_MS = "< 25"
"""The p99 of (c) at c=16: 16 calls in flight, each waiting on the others' turns."""


def run(quick: bool = False, smoke: bool = False) -> Result:
    """`quick`: a short run; `smoke`: a handful of calls (the harness's own test)."""
    result = Result("P1", "mirror overhead: MirrorAllocation vs aio gRPC echo + bare aiohttp "
                    "pod patch")
    serial_count, concurrent_count, warmup = (
        (8, 32, 2) if smoke else (60, 160, 10) if quick else (800, 3000, 100))
    rounds = 2 if smoke else 4 if quick else ROUNDS
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kf-p1-")))
        url = stack.enter_context(running(POD_TEMPLATE, NODE_MEMORY_MIB))
        _seed_mirror_pods(url, 2 * warmup + serial_count + concurrent_count)
        stub_pid = _stub_pid(url)
        config = kubeconfig(url, tmp / "kubeconfig")
        mirror_address, mirror_pid = stack.enter_context(
            mirror_process(config, tmp / "mirror.log"))

        # One real call: its response feeds the echo server, its pod the bare patch's body.
        with grpc.insecure_channel(mirror_address) as channel:
            response = pb_grpc.AllocationMirrorStub(channel).MirrorAllocation(
                request("sample", "p0"), timeout=CALL_TIMEOUT_S)
        written = _pod_annotations(url, "sample", "p0")
        added = {key: value for key, value in written.items()
                 if POD_TEMPLATE["metadata"]["annotations"].get(key) != value}
        canned = response.SerializeToString()
        echo_address = stack.enter_context(echo_process(canned, tmp / "a2"))
        echo_patch_address = stack.enter_context(echo_process(canned, tmp / "d2", config,
                                                              added))
        echo_bare_address = stack.enter_context(echo_process(canned, tmp / "d3", config,
                                                             added, bare=True))
        patch = BarePatch(config, added, read_first=False)
        stack.callback(patch.close)
        get_patch = BarePatch(config, added, read_first=True)
        stack.callback(get_patch.close)

        kinds: dict[str, Callable[[Names, int, int], tuple[list[float], float]]] = {
            "a2": lambda ns, n, c: _grpc(echo_address, ns, n, c),
            "b": lambda ns, n, c: _kube(patch, ns, n, c),
            "b2": lambda ns, n, c: _kube(get_patch, ns, n, c),
            "d2": lambda ns, n, c: _grpc(echo_patch_address, ns, n, c),
            "d3": lambda ns, n, c: _grpc(echo_bare_address, ns, n, c),
            "c": lambda ns, n, c: _grpc(mirror_address, ns, n, c),
        }
        labels = {"a2": "(a2) gRPC echo, aio", "b": "(b) bare PATCH, aiohttp",
                  "b2": "(b2) bare GET+PATCH, aiohttp",
                  "d2": "(d2) aio echo + KubePodStore PATCH",
                  "d3": "(d3) aio echo + bare aiohttp PATCH", "c": "(c) MirrorAllocation"}
        names = {kind: Names(f"bench-{kind}") for kind in kinds}
        for kind, measure in kinds.items():  # warm every path: connections, caches
            measure(names[kind], warmup, 1)
            measure(names[kind], warmup, CONCURRENCY)

        for concurrency, count in ((1, serial_count), (CONCURRENCY, concurrent_count)):
            stats: dict[str, tuple[float, float, float]] = {}
            mirror_cpu = stub_cpu = 0.0
            stub_requests = 0
            # Interleaved, in rounds, so a burst of noise on this machine hits every kind.
            samples: dict[str, list[float]] = {kind: [] for kind in kinds}
            walls: dict[str, float] = dict.fromkeys(kinds, 0.0)
            for _ in range(rounds):
                for kind, measure in kinds.items():
                    if kind == "c":
                        cpu0, stub0, req0 = cpu_seconds(mirror_pid), cpu_seconds(stub_pid), \
                            _stub_requests(url)
                    lat, wall = measure(names[kind], count // rounds, concurrency)
                    if kind == "c":
                        mirror_cpu += cpu_seconds(mirror_pid) - cpu0
                        stub_cpu += cpu_seconds(stub_pid) - stub0
                        stub_requests += _stub_requests(url) - req0
                    samples[kind] += lat
                    walls[kind] += wall
            loaded = concurrency > 1
            for kind in kinds:
                lat = samples[kind]
                stats[kind] = (percentile(lat, 50), percentile(lat, 99), len(lat) / walls[kind])
                p50, p99, rate = stats[kind]
                c = f"c={concurrency}"
                mirror = kind == "c"
                result.add(f"{labels[kind]} p50, {c}", round(p50 * 1e3, 3), "ms")
                result.add(f"{labels[kind]} p99, {c}", round(p99 * 1e3, 3), "ms",
                           TARGET_P99_C16_MS if mirror and loaded else "")
                result.add(f"{labels[kind]} rate, {c}", round(rate), "calls/s",
                           TARGET_RATE_C16 if mirror and loaded else "")
            # Cost of one call: its p50 latency alone, its share of the wall time under load.
            cost = {kind: 1 / rate if loaded else p50
                    for kind, (p50, _, rate) in stats.items()}
            result.add(f"ratio c/(a2+b), c={concurrency}",
                       round(cost["c"] / (cost["a2"] + cost["b"]), 2), "x",
                       "" if loaded else TARGET_RATIO_C1)
            result.add(f"ratio c/(a2+b2), c={concurrency}",
                       round(cost["c"] / (cost["a2"] + cost["b2"]), 2), "x")
            result.add(f"ratio c/d2, c={concurrency}", round(cost["c"] / cost["d2"], 2), "x")
            result.add(f"ratio d3/(a2+b), c={concurrency}",
                       round(cost["d3"] / (cost["a2"] + cost["b"]), 2), "x")
            calls = len(samples["c"])
            result.add(f"mirror CPU per allocation, c={concurrency}",
                       round(mirror_cpu / calls * 1e3, 3), "ms")
            if stub_requests:
                result.add(f"stub CPU per API request, c={concurrency}",
                           round(stub_cpu / stub_requests * 1e3, 3), "ms")
    result.notes.append(
        f"{serial_count} calls at c=1, {concurrent_count} at c={CONCURRENCY} per kind, "
        f"interleaved in {rounds} rounds; every call a new pod; {os.cpu_count()} CPUs shared by "
        "client, mirror and stub")
    return result


def _seed_mirror_pods(url: str, calls: int) -> None:
    """Creates, before the mirror starts, every pod the (c) kind will allocate for (`calls` of
    them, plus a margin): a real pod exists, and the scheduler has seen it, long before it is
    bound, so the mirror knows it from its LIST, not from a GET at allocation time."""
    names = Names("bench-c").take(calls + 2 * CONCURRENCY)  # the names `names["c"]` hands out
    seed(url, "bench-c", [*names, "warm-channel"])  # grpc_serial's first call
    seed(url, "sample", ["p0"])  # the one real call that makes the echo server's response


def _grpc(address: str, names: Names, count: int, concurrency: int
          ) -> tuple[list[float], float]:
    batch = names.take(count)
    if concurrency == 1:
        return grpc_serial(address, names.namespace, batch)
    return grpc_concurrent(address, names.namespace, batch, concurrency)


def _kube(patch: BarePatch, names: Names, count: int, concurrency: int
          ) -> tuple[list[float], float]:
    return patch.measure(names.namespace, names.take(count), concurrency)


def _get_json(url: str, path: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + path, timeout=5) as response:  # the stub, on loopback
        return json.loads(response.read())


def _pod_annotations(url: str, namespace: str, name: str) -> dict[str, str]:
    return _get_json(url, f"/api/v1/namespaces/{namespace}/pods/{name}")["metadata"][
        "annotations"]


def _stub_requests(url: str) -> int:
    return int(_get_json(url, "/stats")["requests"])


def _stub_pid(url: str) -> int:
    return int(_get_json(url, "/stats")["pid"])


# -- profile ----------------------------------------------------------------------------------

def profile(count: int = 2000, top: int = 25) -> None:
    """The mirror's path in-process, under cProfile: servicer -> service (its pod cache primed,
    as the watch keeps it) -> KubePodStore(Kube) -> the stub (in its own process), one call
    after the other on one event loop. gRPC transport is left out (it is (a2)); what is left
    is what the mirror adds."""
    import cProfile
    import pstats

    from kai_fractions.kube.client import Kube
    from kai_fractions.mirror.grpc.servicer import AllocationMirrorServicer
    from kai_fractions.mirror.kube_store import KubePodStore
    from kai_fractions.mirror.pod_cache import PodCache
    from kai_fractions.mirror.service import MirrorService

    class Context:
        def time_remaining(self) -> float:
            return CALL_TIMEOUT_S

        async def abort_with_status(self, status) -> None:
            raise RuntimeError(f"the call failed: {status.code}: {status.details}")

    async def calls(servicer: AllocationMirrorServicer, requests: list) -> None:
        for req in requests:
            await servicer.MirrorAllocation(req, Context())

    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kf-p1-")))
        url = stack.enter_context(running(POD_TEMPLATE, NODE_MEMORY_MIB))
        api = load_api_client(str(kubeconfig(url, tmp / "kubeconfig")))
        stack.callback(api.close)
        cache = PodCache()
        names = [f"p{i}" for i in range(count + 100)]
        seed(url, "profile", names)
        requests = [request("profile", name) for name in names]
        loop = asyncio.new_event_loop()
        stack.callback(loop.close)
        store = KubePodStore(Kube(api))

        async def prime() -> None:  # what the watch would have cached
            for name in names:
                cache.remember(await store.get_pod("profile", name))

        loop.run_until_complete(prime())
        servicer = AllocationMirrorServicer(MirrorService(store, cache=cache))
        loop.run_until_complete(calls(servicer, requests[:100]))
        profiler = cProfile.Profile()
        begin = time.perf_counter()
        profiler.enable()
        loop.run_until_complete(calls(servicer, requests[100:]))
        profiler.disable()
        took = time.perf_counter() - begin
        loop.run_until_complete(store.close())
        print(f"{count} MirrorAllocation calls in-process (profiled): "
              f"{took / count * 1e3:.3f} ms each")
        stats = pstats.Stats(profiler).strip_dirs()
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)


# -- side by side: the pod cache on and off, or two builds ---------------------------------

def compare_cache(count: int = 3000, rounds: int = 3) -> None:
    """Two mirrors against one stub, the default (pod cache on) and `--no-pod-cache`, and (d2),
    each at c=1 and c=16 in alternating rounds of count / rounds calls: rate and mirror CPU.
    The cached mirror's watch also carries the other mirror's writes (both write KAI's pods):
    a cost the comparison counts against the cache."""
    _side_by_side({"cache on": (REPO, ()), "--no-pod-cache": (REPO, ("--no-pod-cache",))},
                  count, rounds, with_d=True)


def compare_metrics(count: int = 3000, rounds: int = 6) -> None:
    """The mirror with its metrics served (`--metrics-listen`, as the chart runs it) and
    without, against one stub in alternating rounds: what counting each call and API request
    costs."""
    _side_by_side({"metrics off": (REPO, ()),
                   "--metrics-listen": (REPO, ("--metrics-listen",
                                               f"127.0.0.1:{_free_port()}"))}, count, rounds)


def compare_tree(other: Path, count: int = 3000, rounds: int = 6) -> None:
    """This checkout's mirror and the one in `other` (another checkout, say a `git worktree`
    of the commit before a change), against one stub in alternating rounds: the way to judge
    a change smaller than the noise between two runs."""
    _side_by_side({"this tree": (REPO, ()), f"{other}": (other.resolve(), ())}, count, rounds)


def _side_by_side(mirrors: dict[str, tuple[Path, tuple[str, ...]]], count: int, rounds: int,
                  with_d: bool = False) -> None:
    """Mirrors (label -> (the checkout it runs from, its flags)), and (d2) when `with_d`,
    against one stub: at c=1 and c=16, in alternating rounds of count / rounds calls each,
    rate, p50 and the mirror's CPU per call. Every pod they write exists before they start.
    (d2) is the aio echo server making the mirror's PATCH through KubePodStore."""
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kf-p1c-")))
        url = stack.enter_context(running(POD_TEMPLATE, NODE_MEMORY_MIB))
        namespaces = {label: f"side-{i}" for i, label in enumerate(mirrors)}
        for namespace in namespaces.values():
            seed(url, namespace, Names("").take(2 * count + 200))
        config = kubeconfig(url, tmp / "kubeconfig")
        servers: dict[str, tuple[str, int | None]] = {}
        names: dict[str, Names] = {}
        if with_d:
            added = {"kai-fractions.io/bench": "x" * 40}
            servers["(d2) echo + PATCH"] = (stack.enter_context(
                echo_process(b"", tmp / "d2", config, added)), None)
            names["(d2) echo + PATCH"] = Names("bench-d2")
        for label, (tree, flags) in mirrors.items():
            servers[label] = stack.enter_context(mirror_process(
                config, tmp / f"{len(servers)}.log", flags=flags, cwd=tree))
            names[label] = Names(namespaces[label])
        for concurrency in (1, CONCURRENCY):
            samples: dict[str, list[float]] = {kind: [] for kind in servers}
            walls, cpus = dict.fromkeys(servers, 0.0), dict.fromkeys(servers, 0.0)
            for kind, (address, _) in servers.items():  # warm
                _grpc(address, names[kind], min(100, count), concurrency)
            for _ in range(rounds):
                for kind, (address, pid) in servers.items():
                    cpu0 = cpu_seconds(pid) if pid else 0.0
                    lat, wall = _grpc(address, names[kind], count // rounds, concurrency)
                    samples[kind] += lat
                    walls[kind] += wall
                    cpus[kind] += cpu_seconds(pid) - cpu0 if pid else 0.0
            for kind in servers:
                calls = len(samples[kind])
                cpu = f", mirror CPU {cpus[kind] / calls * 1e3:.2f} ms per call" \
                    if servers[kind][1] else ""
                print(f"c={concurrency:<2} {kind:18} {calls / walls[kind]:6.0f} calls/s, p50 "
                      f"{percentile(samples[kind], 50) * 1e3:.3f} ms{cpu}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_mirror")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compare-cache", action="store_true",
                        help="the mirror with and without its pod cache, side by side, "
                        "and (d2)")
    parser.add_argument("--compare-metrics", action="store_true",
                        help="the mirror with and without --metrics-listen, side by side")
    parser.add_argument("--compare-tree", type=Path, metavar="CHECKOUT",
                        help="this checkout's mirror and CHECKOUT's, side by side")
    parser.add_argument("--rounds", type=int, default=6,
                        help="with --compare-tree and --compare-metrics")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a handful of calls per kind")
    parser.add_argument("--count", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.profile:
        profile(args.count)
        return 0
    if args.compare_cache:
        compare_cache(args.count)
        return 0
    if args.compare_metrics:
        compare_metrics(args.count, args.rounds)
        return 0
    if args.compare_tree:
        compare_tree(args.compare_tree, args.count, args.rounds)
        return 0
    result = run(quick=args.quick, smoke=args.smoke)
    width = max(len(f.name) for f in result.figures)
    for f in result.figures:
        print(f"{f.name:{width}} {f.value:>12} {f.unit:8} {f.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The load run: N pods, N MirrorAllocation calls through the real gRPC server and its store,
a Kubernetes API that fails 5% of its requests (every kind of FaultyApi fault, transport-level
ones included), and clients that retry UNAVAILABLE / DEADLINE_EXCEEDED with the same
idempotency key, as a scheduler does. Shared by tests/load (CI, a reduced count) and
benchmarks/load_mirror.py (the full 10,000).

Counted at the API server, per pod: writes applied. Exactly one per pod is an effective
allocation; more is a duplicate; none is a lost one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from kai_fractions.api.v1 import allocation_pb2 as pb
from kai_fractions.contract import parse_pod, plan_pod, view_from_pod_spec
from kai_fractions.kube.retry import Backoff
from kai_fractions.mirror.record import MIRRORED_ANNOTATION, decode_record
from kai_fractions.signing import Keyring, signature_key
from tests.faults.mirror_rig import SIGNING_KEY, mirror_over
from tests.support.faults_api import FaultyApi, RandomFaults

GPU = "GPU-1111aaaa-0000-4000-8000-000000000001"
NAMESPACE = "load"
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
MAX_CLIENT_TRIES = 30
STORE_BACKOFF = Backoff(attempts=2, base=0.01, cap=0.02)
"""Two tries per API request inside the mirror, so that some calls do reach the client as
UNAVAILABLE and the client's own retries are exercised too (~0.25% of requests fail twice)."""


@dataclass
class LoadReport:
    calls: int
    seconds: float
    client_attempts: int = 0
    client_retries: int = 0
    retried_codes: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    api_requests: int = 0
    patch_requests: int = 0
    writes: int = 0
    effective: int = 0
    duplicates: int = 0
    lost: int = 0
    bad_signatures: int = 0
    faults: Counter = field(default_factory=Counter)

    @property
    def fault_count(self) -> int:
        return sum(self.faults.values())

    def lines(self) -> list[str]:
        faults = ", ".join(f"{k}={v}" for k, v in sorted(self.faults.items()))
        codes = ", ".join(f"{k.name}={v}" for k, v in sorted(self.retried_codes.items(),
                                                             key=lambda kv: kv[0].name))
        return [
            f"MirrorAllocation calls: {self.calls} in {self.seconds:.2f} s "
            f"({self.calls / self.seconds:.0f}/s)",
            f"effective allocations: {self.effective}, duplicates: {self.duplicates}, "
            f"lost: {self.lost}, bad signatures: {self.bad_signatures}, "
            f"client errors: {len(self.errors)}",
            f"API requests: {self.api_requests} (PATCH {self.patch_requests}, writes applied "
            f"{self.writes}); injected faults: {self.fault_count} ({faults})",
            f"client attempts: {self.client_attempts} ({self.client_retries} retries: "
            f"{codes or 'none'})",
        ]


def _allocation(name: str, uid: str) -> pb.Allocation:
    return pb.Allocation(
        pod=pb.PodRef(namespace=NAMESPACE, name=name, uid=uid), selected_node="gpu-node-1",
        received_resource_type=pb.RECEIVED_RESOURCE_TYPE_FRACTION,
        received_gpu=pb.ReceivedGpu(count=1, portion="0.5"),
        selected_fractional_gpu_groups=[pb.FractionalGpuGroup(
            id=f"group-{name}", compute_sharing_mode=pb.COMPUTE_SHARING_MODE_TIME_SLICING)],
        reserved_gpu_ids=[GPU], node_gpu_memory_mib=40960)


def run_load(count: int, *, fault_rate: float = 0.05, seed: int = 10,
             workers: int = 8, hold_seconds: float = 1.0) -> LoadReport:
    api = FaultyApi(hold_seconds=hold_seconds).start()
    try:
        pods = [api.add_pod(f"pod-{i:05d}", {"gpu-fraction": "0.5"}, namespace=NAMESPACE)
                for i in range(count)]
        api.random = RandomFaults(fault_rate, seed=seed)
        report = LoadReport(calls=count, seconds=0.0)
        lock = threading.Lock()
        work: queue.Queue = queue.Queue()
        for pod in pods:
            work.put(pod)
        with mirror_over(api, store_backoff=STORE_BACKOFF) as rig:

            def client() -> None:
                while True:
                    try:
                        pod = work.get_nowait()
                    except queue.Empty:
                        return
                    meta = pod["metadata"]
                    request = pb.MirrorAllocationRequest(
                        allocation=_allocation(meta["name"], meta["uid"]),
                        idempotency_key=f"bind/{meta['name']}")
                    for attempt in range(MAX_CLIENT_TRIES):
                        try:
                            rig.stub.MirrorAllocation(request, timeout=10)
                        except grpc.RpcError as e:
                            with lock:
                                report.client_attempts += 1
                                if e.code() in RETRYABLE and attempt + 1 < MAX_CLIENT_TRIES:
                                    report.client_retries += 1
                                    report.retried_codes[e.code()] += 1
                                    continue
                                report.errors.append(f"{meta['name']}: {e.code().name}: "
                                                     f"{e.details()}")
                            break
                        with lock:
                            report.client_attempts += 1
                        break

            started = time.perf_counter()
            threads = [threading.Thread(target=client, name=f"load-client-{i}")
                       for i in range(workers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            report.seconds = time.perf_counter() - started
        api.random = None
        _count(api, report)
        return report
    finally:
        api.stop()


def _count(api: FaultyApi, report: LoadReport) -> None:
    keyring = Keyring.of(SIGNING_KEY)

    def snapshot():
        cluster = api.cluster
        return (cluster.requests, dict(cluster.faults_served),
                {key: (vars(s).copy(), cluster.pods[key]) for key, s in cluster.stats.items()})

    requests, faults, per_pod = api.call(snapshot)
    report.api_requests = requests
    report.faults = Counter({str(k): v for k, v in faults.items()})
    for _key, (stats, obj) in sorted(per_pod.items()):
        report.patch_requests += stats["patch_requests"]
        report.writes += stats["writes"]
        annotations = obj["metadata"].get("annotations") or {}
        record = decode_record(annotations.get(MIRRORED_ANNOTATION))
        if stats["writes"] == 0 or record is None:
            report.lost += 1
            continue
        if stats["writes"] > 1:
            report.duplicates += 1
        else:
            report.effective += 1
        (plan,) = plan_pod(parse_pod(view_from_pod_spec(obj["metadata"], obj["spec"])))
        if not keyring.verify(plan, annotations.get(signature_key(plan))).ok:
            report.bad_signatures += 1

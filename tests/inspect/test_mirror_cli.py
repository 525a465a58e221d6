"""`kai-fractions inspect mirror`: replicas read at the URLs given (each a real metrics endpoint
serving `MirrorMetrics`), or found through the Kubernetes API (kmock) and read through the API
server's pod proxy; the exit code says whether anything is wrong. The real two-replica run is
in tests/mirror/test_leader_process.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kai_fractions.cli import main
from kai_fractions.inspect.mirror_sources import DEFAULT_NAMESPACE
from kai_fractions.inspect.mirror_state import MIN_JUDGED
from kai_fractions.metrics_http import MetricsEndpoint
from kai_fractions.mirror.metrics import MirrorMetrics
from tests.support.kube import KubeServer
from tests.support.mirror_kube import honour_label_selectors

from .mirrors import mirror_metrics, scrape

NS = DEFAULT_NAMESPACE
LABELS = {"app.kubernetes.io/name": "kai-fractions", "app.kubernetes.io/component": "mirror"}


def _inspect(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["inspect", "mirror", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def in_the_window(monkeypatch) -> list:
    """What the replicas do between inspect's two reads: run instead of its wait."""
    actions: list = []

    def sleep(seconds: float) -> None:
        assert seconds == 5.0  # --window's default
        for action in actions:
            action()

    monkeypatch.setattr("kai_fractions.cli.inspect._sleep", sleep, raising=False)
    return actions


def _calls(metrics: MirrorMetrics, code: str, n: int, api: str = "") -> None:
    for _ in range(n):
        metrics.call("MirrorAllocation", code, 0.01)
        if api:
            metrics.api_request("GET", api)


@pytest.fixture
def serve() -> Iterator:
    endpoints: list[MetricsEndpoint] = []

    def serve(metrics: MirrorMetrics) -> str:
        endpoint = MetricsEndpoint(metrics.registry)
        endpoints.append(endpoint)
        host, port = endpoint.serve("127.0.0.1:0")
        return f"{host}:{port}"

    yield serve
    for endpoint in endpoints:
        endpoint.close()


# -- at the URLs given ------------------------------------------------------------------------

def test_one_leader_among_the_replicas_is_all_well(serve, capsys):
    a, b = serve(mirror_metrics()), serve(mirror_metrics(leading=False))
    code, out, err = _inspect(capsys, a, f"http://{b}/metrics")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"mirror: 2 of 2 replicas read, follower led by {a}"
    assert lines[2].split()[:2] == [a, "leading"]
    assert lines[3].split()[:2] == [f"http://{b}/metrics", "standby"]
    assert not [line for line in lines if line.startswith("!")]


def test_a_replica_failing_now_exits_1_whatever_its_history(serve, in_the_window, capsys):
    """Judged on the totals since it started, 12 failures now among 2000 healthy calls were
    diluted under 5 %: nothing was wrong."""
    metrics = mirror_metrics(ok=0, invalid=0, leading=None, signed_after=(), skipped=0)
    _calls(metrics, "OK", 2000, api="200")
    in_the_window.append(lambda: _calls(metrics, "UNAVAILABLE", 12, api="unreachable"))
    code, out, _ = _inspect(capsys, serve(metrics))
    assert code == 1
    problems = [line for line in out.splitlines() if line.startswith("! ")]
    assert [p.split(": ", 2)[1] for p in problems] == [
        "12 of its 12 requests to the API server failed in the last 5 s (unreachable 12)",
        "12 of its 12 calls failed in the last 5 s (UNAVAILABLE 12)"]
    assert "in the last 5 s: calls UNAVAILABLE 12 and API unreachable 12" in out


def test_an_early_failure_is_not_a_problem_for_ever(serve, in_the_window, capsys):
    """One DEADLINE_EXCEEDED at its start made every later inspect exit 1."""
    metrics = mirror_metrics(ok=0, invalid=0, leading=None, signed_after=(), skipped=0)
    _calls(metrics, "DEADLINE_EXCEEDED", 1, api="unreachable")
    in_the_window.append(lambda: _calls(metrics, "OK", 15, api="200"))
    code, out, _ = _inspect(capsys, serve(metrics))
    assert (code, [line for line in out.splitlines() if line.startswith("!")]) == (0, [])

    in_the_window[:] = [lambda: _calls(metrics, "UNAVAILABLE", MIN_JUDGED - 1)]
    code, out, _ = _inspect(capsys, serve(metrics))
    assert code == 0  # too few to judge
    assert f"in the last 5 s: calls UNAVAILABLE {MIN_JUDGED - 1}" in out


def test_window_0_judges_the_totals_and_a_negative_one_is_refused(serve, capsys):
    metrics = mirror_metrics(ok=0, invalid=0, leading=None, signed_after=(), skipped=0)
    _calls(metrics, "INTERNAL", MIN_JUDGED)
    code, out, _ = _inspect(capsys, serve(metrics), "--window", "0")
    assert code == 1 and f"{MIN_JUDGED} of its {MIN_JUDGED} calls failed since it started" in out
    code, out, err = _inspect(capsys, serve(metrics), "--window", "-1")
    assert (code, out) == (2, "")
    assert err == "kai-fractions inspect: --window: must be 0 or more seconds, got -1\n"


def test_two_leaders_a_dead_replica_and_a_wrong_endpoint_are_problems(serve, capsys):
    from prometheus_client import CollectorRegistry, Gauge

    other = CollectorRegistry()
    Gauge("up", "not a mirror", registry=other).set(1)
    endpoint = MetricsEndpoint(other)
    host, port = endpoint.serve("127.0.0.1:0")
    try:
        a, b = serve(mirror_metrics()), serve(mirror_metrics())
        code, out, _ = _inspect(capsys, a, b, f"{host}:{port}", "127.0.0.1:1", "-o", "json")
    finally:
        endpoint.close()
    data = json.loads(out)
    assert code == 1 and data["leader"] is None
    assert [r["reachable"] for r in data["replicas"]] == [True, True, False, False]
    assert data["problems"][0] == (f"{host}:{port}: not read: not a mirror's metrics: no "
                                   "kai_fractions_mirror_* series: not a mirror's metrics")
    assert data["problems"][1].startswith("127.0.0.1:1: not read: URLError: ")
    assert data["problems"][2].startswith(f"2 replicas follow BindRequests at once ({a}, {b})")


# -- found through the Kubernetes API ---------------------------------------------------------

def mirror_pod(name: str, *, phase: str = "Running", port: int | None = 9401,
               labels: dict[str, str] = LABELS) -> dict:
    ports = [{"name": "grpc", "containerPort": 8443}]
    if port is not None:
        ports.append({"name": "metrics", "containerPort": port})
    return {"metadata": {"name": name, "namespace": NS, "labels": dict(labels)},
            "spec": {"containers": [{"name": "mirror", "image": "kai-fractions",
                                     "ports": ports}]},
            "status": {"phase": phase}}


def create(kube: KubeServer, pod: dict) -> None:
    status = pod.pop("status")
    kube.core.create_namespaced_pod(NS, pod)
    kube.core.patch_namespaced_pod_status(pod["metadata"]["name"], NS, {"status": status})


def proxied(name: str, port: int = 9401) -> str:
    return f"/api/v1/namespaces/{NS}/pods/{name}:{port}/proxy/metrics"


@pytest.fixture
def cluster(kube: KubeServer, tmp_path: Path) -> tuple[KubeServer, str]:
    honour_label_selectors(kube)
    for name, leading in (("kai-fractions-mirror-a", True), ("kai-fractions-mirror-b", False)):
        create(kube, mirror_pod(name))
        text = scrape(mirror_metrics(leading=leading))
        kube.emulator["get", proxied(name)] << (lambda _request, text=text: text.encode())
    create(kube, mirror_pod("kai-fractions-node-agent-x", labels={
        **LABELS, "app.kubernetes.io/component": "node-agent"}))
    return kube, str(kube.write_kubeconfig(tmp_path / "kubeconfig"))


def test_the_mirror_pods_are_found_and_read_through_the_api_server(cluster, capsys):
    kube, kubeconfig = cluster
    code, out, err = _inspect(capsys, "--kubeconfig", kubeconfig)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (f"mirror: 2 of 2 replicas read in namespace {NS}, follower led by "
                        "kai-fractions-mirror-a")
    assert [line.split()[:2] for line in lines[2:4]] == [
        ["kai-fractions-mirror-a", "leading"], ["kai-fractions-mirror-b", "standby"]]
    assert "node-agent" not in out  # another component's pod, though the API sent it
    assert kube.count("GET", proxied("kai-fractions-mirror-a")) == 2  # --window apart
    listing = kube.requests("GET", f"/api/v1/namespaces/{NS}/pods")[-1]
    assert listing.params["labelSelector"] == ",".join(f"{k}={v}" for k, v in LABELS.items())


def test_a_replica_the_proxy_refuses_says_what_to_do_instead(cluster, capsys):
    kube, kubeconfig = cluster
    kube.fail("GET", proxied("kai-fractions-mirror-b"), 403, times=None,
              message="pods/proxy forbidden")
    create(kube, mirror_pod("kai-fractions-mirror-c", phase="Pending"))
    create(kube, mirror_pod("kai-fractions-mirror-d", port=None))
    code, out, _ = _inspect(capsys, "--kubeconfig", kubeconfig, "-o", "json")
    data = json.loads(out)
    assert code == 1 and data["leader"] == "kai-fractions-mirror-a"
    b, c, d = data["replicas"][1:]
    assert b["error"].startswith("pod kai-fractions/kai-fractions-mirror-b:9401/metrics via "
                                 "the API server: the API server refused")
    assert "403" in b["error"] and "pods/proxy forbidden" in b["error"]
    assert "needs get on pods/proxy in kai-fractions" in b["error"]
    assert ("kubectl -n kai-fractions port-forward pod/kai-fractions-mirror-b 9401, then "
            "inspect mirror http://127.0.0.1:9401") in b["error"]
    assert c["error"] == "the pod is Pending, not Running"
    assert d["error"].startswith("no container port named 'metrics'")
    assert len(data["problems"]) == 3


def test_no_mirror_pod_is_a_problem_and_a_broken_cluster_a_usage_error(kube, tmp_path, capsys):
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig"))
    code, out, _ = _inspect(capsys, "--kubeconfig", kubeconfig, "--namespace", "elsewhere")
    assert code == 1
    assert out.splitlines() == [
        "mirror: 0 of 0 replicas read in namespace elsewhere, follower unknown",
        "! no mirror replica found: no pod matched the selector in that namespace (-n names "
        "the release's namespace; or pass the replicas' metrics URLs)"]

    code, out, err = _inspect(capsys, "--kubeconfig", kubeconfig, "--selector", " ")
    assert (code, out) == (2, "")
    assert err.startswith("kai-fractions inspect: --selector: must not be empty")

    kube.fail("GET", f"/api/v1/namespaces/{NS}/pods", 403, message="cannot list pods")
    code, out, err = _inspect(capsys, "--kubeconfig", kubeconfig)
    assert (code, out) == (2, "")
    assert "403" in err and "cannot list pods" in err

    code, _, err = _inspect(capsys, "--kubeconfig", str(tmp_path / "missing"))
    assert code == 2 and "missing" in err

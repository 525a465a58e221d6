"""P2 node convergence: a pod is bound -> its limits are applied -> its readiness marker is
written, through the real node agent on a simulated 8-GPU node (`benchmarks.node_sim`: fake
NVML library via the real pynvml, real MPS control daemon, real cgroup tree walking, the agent's
in-memory Kubernetes).

Time starts when the bound pod appears in the API (its cgroup slice already made, as the
kubelet does before the gate starts) and stops when the agent has written its marker: watch
event -> worker wakes -> pass (MPS supervision, NVML inventory, desired-state planning over
every pod, engine apply with NVML cgroup limits, marker write with fsync). Figures:

* one pod at a time on a node already running BACKGROUND pods: p50 / p99;
* 100 pods bound at once (as fast as the API takes them) on 8 GPUs: wall time until the 100th
  marker, and the passes that took.

Half the GPUs share by MPS (sm-sharing), half by time slicing, so both paths are in it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .harness import Result, percentile
from .node_sim import SimNode, sim_node, wait_until

GPUS = 8
BACKGROUND = 16
BURST = 100
TIMEOUT_S = 30.0


class MarkerClock:
    """When the agent finished writing each pod's marker (its MarkerStore.write, wrapped)."""

    def __init__(self, node: SimNode) -> None:
        self.written: dict[str, float] = {}
        self.states: dict[str, set[str]] = {}
        self._cond = threading.Condition()
        store = node.agent.reconciler.markers
        original = store.write

        def write(uid, entries, *args, **kwargs):
            out = original(uid, entries, *args, **kwargs)
            with self._cond:
                self.written[uid] = time.perf_counter()
                self.states[uid] = {e.state.value for e in entries.values()}
                self._cond.notify_all()
            return out

        store.write = write

    def wait(self, uids: list[str], timeout: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(u in self.written for u in uids):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [u for u in uids if u not in self.written]
                    raise RuntimeError(f"no marker for {len(missing)} pod(s) within {timeout} s")
                self._cond.wait(left)
        bad = {u: self.states[u] for u in uids if self.states[u] != {"applied"}}
        if bad:
            raise RuntimeError(f"markers not 'applied': {bad}")


@contextmanager
def _settled_node(background: int) -> Iterator[tuple[SimNode, MarkerClock]]:
    """A started agent whose first passes are done, with `background` running pods applied."""
    with sim_node(GPUS) as node:
        clock = MarkerClock(node)
        wait_until(lambda: node.agent.reconciler.passes >= 1, "the agent's first pass",
                   TIMEOUT_S)
        uids = []
        for i in range(background):
            pod = node.pod(10_000 + i, i % GPUS, running=True)
            node.make_cgroups(pod)
            node.cluster.add_pod(pod)
            uids.append(pod["metadata"]["uid"])
        clock.wait(uids)
        yield node, clock


def _passes(node: SimNode) -> tuple[float, float]:
    """(passes so far, seconds they took), once the pass in progress has finished."""
    wait_until(lambda: node.agent.worker.busy_for() is None, "the pass in progress",
               TIMEOUT_S)
    registry = node.agent.metrics.registry
    name = "kai_fractions_reconcile_duration_seconds"
    return (registry.get_sample_value(f"{name}_count") or 0.0,
            registry.get_sample_value(f"{name}_sum") or 0.0)


def one_at_a_time(samples: int) -> tuple[list[float], float]:
    """(seconds from bind to marker per pod, mean seconds per pass meanwhile)."""
    out = []
    with _settled_node(BACKGROUND) as (node, clock):
        passes0, spent0 = _passes(node)
        for i in range(samples):
            pod = node.pod(i, i % GPUS, running=False)
            uid = pod["metadata"]["uid"]
            node.make_cgroups(pod)
            start = time.perf_counter()
            node.cluster.add_pod(pod)
            clock.wait([uid])
            out.append(clock.written[uid] - start)
            # gone again, and forgotten by the agent, before the next one is bound
            node.cluster.delete_pod(uid)
            node.remove_cgroups(uid)
            wait_until(lambda uid=uid: not (node.markers / uid).exists(),
                       "the agent to forget a deleted pod", TIMEOUT_S)
            wait_until(lambda: node.agent.worker.busy_for() is None, "the pass in progress",
                       TIMEOUT_S)
        passes, spent = _passes(node)
    return out, (spent - spent0) / max(1.0, passes - passes0)


def burst(count: int) -> tuple[float, float, float]:
    """(seconds to the last marker, passes it took, mean seconds per pass)."""
    with _settled_node(0) as (node, clock):
        pods = [node.pod(i, i % GPUS, running=False) for i in range(count)]
        for pod in pods:
            node.make_cgroups(pod)
        passes0, spent0 = _passes(node)
        start = time.perf_counter()
        for pod in pods:
            node.cluster.add_pod(pod)
        uids = [p["metadata"]["uid"] for p in pods]
        clock.wait(uids)
        took = max(clock.written[u] for u in uids) - start
        passes, spent = _passes(node)
        runs = passes - passes0
        return took, runs, (spent - spent0) / runs if runs else 0.0


def run(quick: bool = False, smoke: bool = False) -> Result:
    """`quick`: fewer samples; `smoke`: a handful (the harness's own test)."""
    result = Result("P2", f"node convergence: bound -> limits -> marker ({GPUS} GPUs)")
    samples = 3 if smoke else 40 if quick else 200
    lat, per_pass = one_at_a_time(samples)
    result.add("one pod p50", round(percentile(lat, 50) * 1e3, 2), "ms")
    result.add("one pod p99", round(percentile(lat, 99) * 1e3, 2), "ms", "<= 100")
    result.add("one pod max", round(max(lat) * 1e3, 2), "ms")
    result.add(f"one pod: mean pass ({BACKGROUND + 1} pods)", round(per_pass * 1e3, 2), "ms")
    count = 10 if smoke else BURST
    took, passes, per_pass = burst(count)
    result.add(f"{count} pods at once: last marker", round(took, 3), "s",
               "<= 2" if count == BURST else "")
    result.add(f"{count} pods at once: passes", passes, "passes")
    result.add(f"{count} pods at once: mean pass", round(per_pass * 1e3, 2), "ms")
    result.notes.append(
        f"one pod: {samples} samples, each on a node running {BACKGROUND} applied pods; "
        "half the GPUs sm-sharing (MPS, legacy daemon), half time-slicing; NVML is the fake "
        "library (re-reads its config file on every call)")
    return result


if __name__ == "__main__":
    for f in run(quick=True).figures:
        print(f"{f.name:42} {f.value:>12} {f.unit:8} {f.target}")

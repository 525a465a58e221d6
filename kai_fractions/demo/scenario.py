"""The demo's story, step by step, over a started `DemoSession`:

1. admit the example pods (mutating + validating webhook logic) and create them in the API;
   the webhooks' warnings are kept for step 5;
2. schedule them: size each with PreviewAllocation, place it (`Placer`), MirrorAllocation over
   gRPC, bind; a pod that fits nowhere stays Pending with the reason (PodScheduled=False). Like
   a patched KAI, it binds a pod upstream KAI main may never bind (a warning says which), and
   it ignores the node's condition (KAI places nothing on a node where it is not True): a node
   agent that refuses its pods is worth showing;
3. play the kubelet: start each bound pod's gate, which waits for the node agent's marker;
   the workload starts only when the gate releases it;
4. start a simulated CUDA process in each running container and wait until the agent sees it;
5. once the agent has published its node condition, print the per-GPU table (the `inspect`
   report, the agent reached through its socket) with the memory tier that enforces each row,
   each pod's admission warnings, and a note where the demo did what KAI would not
   (`report_notes`);
6. let one container's process ask for more than its cap: a hard tier the agent reports in
   force for it (cgroup, mps-pinned: what its TIER says) makes the allocation fail (the
   simulated NVML or MPS client refuses it, and the line says so). With
   `watchdog_policy: kill` a container only the watchdog watches is applied: its allocation
   succeeds and the watchdog stops the process afterwards (its LimitEnforced event shows; the
   demo's killer records the stop and sends no signal, and says so). With `report` (the
   default) the watchdog stops nothing, so it is never a container's only tier: such a
   container is refused, and does not run to be pushed over its cap;
7. show a manifest the admission webhook refuses, with its message.

Progress goes to `progress` (stderr); the tables and findings to `out` (stdout).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from ..api.v1 import allocation_pb2 as pb
from ..contract import (
    MIB,
    ContainerShare,
    ContractViolation,
    parse_pod,
    plan_pod,
    view_from_pod_spec,
)
from ..contract import keys as k
from ..inspect.model import ENFORCED, REFUSED, Report, Row, node_report
from ..inspect.render import mib, table
from ..inspect.sources import agent_from_socket, agent_state
from ..node.agent import events as ev
from ..node.config import WatchdogPolicy
from ..sim.nvml import GpuOutOfMemory
from .admission_step import USER, admission_config, admit
from .first_call import FirstCall
from .first_call import manifest as first_call_manifest
from .kubelet import CapHeld, GateResult, SimulatedKubelet
from .report_notes import annotated, rowless
from .scheduler import Ask, GpuSlot, Placer, allocation, idempotency_key, request_mib
from .session import DemoSession, gpu_summary
from .workloads import DemoPod, forged_gpu_pod, load_examples

WAIT_SECONDS = 15.0
POLL_SECONDS = 0.05
USED_SHARE = (3, 4)
"""A running container's simulated process uses 3/4 of its memory request."""
OVER_CAP_MIB = 1024
"""How far above its cap the over-asking process would take its container."""
HELD, CAUGHT, NOTHING = "Cap held", "Violation caught", "Over the cap"
"""The titles of step 6's section: a hard tier refused it, a `kill` watchdog stopped it, and
neither (no container runs to be pushed over its cap, or nothing that caps it is in force)."""


class DemoFailure(Exception):
    """A step the demo depends on did not happen in time (the message says which)."""


@dataclass
class Outcome:
    report: Report | None = None
    over_cap_title: str = NOTHING
    unscheduled: dict[str, str] = field(default_factory=dict)
    gates: dict[str, GateResult] = field(default_factory=dict)
    violation: list[str] = field(default_factory=list)
    rejection: list[str] = field(default_factory=list)
    warned: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """The admission warnings of each created pod that got any, by `namespace/name`."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each created pod came from (its manifest), by `namespace/name`."""
    bound: list[str] = field(default_factory=list)
    """The pods the demo's scheduler bound, by `namespace/name`."""


def _wait(what: str, probe: Callable[[], Any], timeout: float = WAIT_SECONDS) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise DemoFailure(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(POLL_SECONDS)


def _held_by(report: Report, row: Row) -> frozenset[str]:
    """How the agent reports the row's memory cap in force on its GPU (GetNodeState's applied
    limits, which its TIER shows the strongest of): what the simulated driver and MPS client
    refuse an allocation by."""
    found = report.agent.allocation(row.namespace, row.pod, row.container) if report.agent else None
    return found.mechanisms.get(row.gpu_uuid, frozenset()) if found is not None else frozenset()


def _share(pod: Mapping[str, Any], session: DemoSession) -> ContainerShare | None:
    view = view_from_pod_spec(pod["metadata"], pod["spec"])
    return parse_pod(view, session.keys).share


class Scenario:
    def __init__(self, session: DemoSession, out: TextIO, progress: Callable[[str], None]):
        self.s = session
        self.out = out
        self.progress = progress
        self.core = session.core
        self.node = session.config.node
        self.kubelet = SimulatedKubelet(
            session.core, self.node, session.marker_dir, session.workdir, session.keys,
            session.nvml, session.proc_root, session.node_config.layout)
        self.outcome = Outcome()
        self.placer: Placer | None = None
        self.pids: dict[tuple[str, str, str], list[int]] = {}
        """(pod uid, container, gpu) -> simulated process ids."""

    # -- helpers -----------------------------------------------------------------------------

    def _pod(self, namespace: str, name: str) -> dict[str, Any]:
        return self.core.api_client.sanitize_for_serialization(
            self.core.read_namespaced_pod(name, namespace))

    def _all_pods(self) -> list[dict[str, Any]]:
        pods = self.core.list_pod_for_all_namespaces().items
        return [self.core.api_client.sanitize_for_serialization(p) for p in pods]

    def _node(self) -> dict[str, Any]:
        return self.core.api_client.sanitize_for_serialization(self.core.read_node(self.node))

    # -- 1. admission ---------------------------------------------------------------------------

    def create(self, pods: list[DemoPod]) -> list[dict[str, Any]]:
        config = admission_config(self.s.keys)
        created = []
        for demo_pod in pods:
            admitted = admit(demo_pod.manifest, config)
            ref = f"{demo_pod.namespace}/{demo_pod.name}"
            if not admitted.allowed:
                # An example the webhook refuses is worth showing, not hiding.
                self.outcome.rejection.append(
                    f"pod {ref} ({demo_pod.source}): {admitted.decision.code} "
                    f"{admitted.decision.reason}: {admitted.decision.message}")
                continue
            assert admitted.pod is not None
            pod = self.core.api_client.sanitize_for_serialization(
                self.core.create_namespaced_pod(demo_pod.namespace, admitted.pod))
            created.append(pod)
            self.outcome.sources[ref] = demo_pod.source
            warned = len(admitted.warnings)
            if warned:
                self.outcome.warned[ref] = admitted.warnings
            self.progress(f"admitted {ref} from {demo_pod.source}: "
                          + ("; ".join(admitted.wired) or "not fractional, unchanged")
                          + (f"; {warned} admission warning{'s' if warned > 1 else ''} "
                             "(printed with the report)" if warned else ""))
        return created

    # -- 2. scheduling --------------------------------------------------------------------------

    def _unschedulable(self, pod: Mapping[str, Any], message: str) -> None:
        meta = pod["metadata"]
        ref = f"{meta['namespace']}/{meta['name']}"
        self.outcome.unscheduled[ref] = message
        self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": {
            "phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": message}]}})
        self.progress(f"not scheduled {ref}: {message}")

    def schedule(self, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        import grpc

        inventory = self.s.nvml.devices()
        reserve = self.s.config.mirror_reserve_mib
        slots = [GpuSlot(d.index, d.uuid, self.s.gpu_memory_mib - reserve) for d in inventory]
        placer = self.placer = Placer(slots)
        bound = []
        for pod in pods:
            meta = pod["metadata"]
            ref = f"{meta['namespace']}/{meta['name']}"
            share = _share(pod, self.s)
            if share is None:
                continue  # not fractional: nothing of ours to decide
            if share.num_devices > len(slots):
                self._unschedulable(pod, f"it asks for {share.num_devices} GPUs, node "
                                    f"{self.node} has {len(slots)}")
                continue
            try:
                preview = self.s.stub.PreviewAllocation(pb.PreviewAllocationRequest(
                    allocation=allocation(pod, share, self.node,
                                          [s.uuid for s in slots[: share.num_devices]])),
                    timeout=10)
                ask = Ask(ref, share.compute_mode, request_mib(preview), share.num_devices)
                chosen = placer.place(ask)
                if isinstance(chosen, str):
                    self._unschedulable(pod, chosen)
                    continue
                gpus = [g.uuid for g in chosen]
                reply = self.s.stub.MirrorAllocation(pb.MirrorAllocationRequest(
                    allocation=allocation(pod, share, self.node, gpus),
                    idempotency_key=idempotency_key(pod)), timeout=10)
            except grpc.RpcError as e:
                self._unschedulable(pod, f"the mirror refused the allocation: "
                                    f"{e.code().name}: {e.details()}")
                continue
            bound_pod = self.core.api_client.sanitize_for_serialization(
                self.core.patch_namespaced_pod(meta["name"], meta["namespace"], {
                    "metadata": {"uid": meta["uid"]}, "spec": {"nodeName": self.node}}))
            bound.append(bound_pod)
            self.outcome.bound.append(ref)
            where = ", ".join(f"GPU {g.index}" for g in chosen)
            self.progress(f"scheduled {ref} on {where} ({ask.request_mib} MiB, "
                          f"{share.compute_mode.value}): MirrorAllocation wrote "
                          f"{len(reply.annotations)} annotations (changed={reply.changed}), "
                          f"bound to {self.node}")
        return bound

    # -- 3. kubelet and gates -----------------------------------------------------------------

    def start_pods(self, bound: list[dict[str, Any]]) -> list[dict[str, Any]]:
        running = []
        for pod in bound:
            meta = pod["metadata"]
            ref = f"{meta['namespace']}/{meta['name']}"
            self.kubelet.start(pod)
            fresh = self._pod(meta["namespace"], meta["name"])
            result = self.kubelet.run_gate(fresh)
            self.outcome.gates[ref] = result
            after = self.kubelet.finish(fresh, result)
            if result.released:
                running.append(after)
                self.progress(f"gate {ref}: released, containers running")
            else:
                self.progress(f"gate {ref}: FAILED (exit {result.exit_code}): {result.message}")
        return running

    # -- 4. processes ---------------------------------------------------------------------------

    def start_processes(self, running: list[dict[str, Any]]) -> dict[tuple[str, str, str], int]:
        """One process per container and GPU using 3/4 of its request; what the agent must
        report afterwards, per (namespace, pod, container)."""
        expected: dict[tuple[str, str, str], int] = {}
        for pod in running:
            meta = pod["metadata"]
            try:
                plans = plan_pod(parse_pod(view_from_pod_spec(meta, pod["spec"]), self.s.keys),
                                 keys=self.s.keys)
            except ContractViolation:
                continue
            for plan in plans:
                used = plan.request_mib * USED_SHARE[0] // USED_SHARE[1] * MIB
                for gpu in plan.device_uuids:
                    pid = self.kubelet.start_process(pod, plan.container, gpu, used)
                    self.pids.setdefault((meta["uid"], plan.container, gpu), []).append(pid)
                key = (meta["namespace"], meta["name"], plan.container)
                expected[key] = used * len(plan.device_uuids)
        return expected

    def _agent_sees(self, expected: Mapping[tuple[str, str, str], int]) -> bool:
        state = agent_from_socket(str(self.s.endpoints.agent_socket))
        if not state.reachable:
            return False
        for (ns, pod, container), used in expected.items():
            found = state.allocation(ns, pod, container)
            if found is None or found.used_bytes != used:
                return False
        return True

    # -- 5. the report ---------------------------------------------------------------------------

    def _condition_published(self) -> bool:
        conditions = (self._node().get("status") or {}).get("conditions") or []
        return any(c.get("type") == k.NODE_CONDITION for c in conditions)

    def report(self) -> Report:
        endpoints = self.s.endpoints
        agent = agent_state(str(endpoints.agent_socket), endpoints.metrics_url)
        pods = [p for p in self._all_pods()
                if (p.get("spec") or {}).get("nodeName") in ("", None, self.node)]
        report = node_report(self.node, self._node(), pods, agent, keys=self.s.keys)
        return annotated(report, self.outcome.warned, self.outcome.bound)

    # -- 6. the violation ------------------------------------------------------------------------

    def violate(self, report: Report) -> list[str]:
        """The first enforced container's process asks for enough to end OVER_CAP_MIB above the
        container's cap: what stops it is the tier the table shows for that row. A hard tier
        (cgroup, mps-pinned) refuses the allocation; a watchdog with the `kill` policy lets it
        succeed and stops the process afterwards (recorded by the demo's killer, not signalled).
        A `report` watchdog is never a row's only tier: the agent refuses such a container."""
        victim = next((r for g in report.gpus for r in g.rows
                       if r.state == ENFORCED and r.limit_bytes), None)
        if victim is None:
            self.outcome.over_cap_title = NOTHING
            refused = any(r.state.startswith(REFUSED) for r in report.rows)
            return ["(no running container to push over its cap" + (
                ": the node agent refused the fractional containers it could not cap, see the "
                "reasons above)" if refused else ")")]
        pod = self._pod(victim.namespace, victim.pod)
        uid = pod["metadata"]["uid"]
        pid = self.pids[(uid, victim.container, victim.gpu_uuid)][0]
        using = victim.used_bytes or 0
        extra = victim.limit_bytes - using + OVER_CAP_MIB * MIB
        gpu_index = next(g.index for g in report.gpus if g.uuid == victim.gpu_uuid)
        tier = victim.tier
        held_by = _held_by(report, victim)
        asked = (f"{victim.ref} on GPU {gpu_index} (tier {tier}): its process (pid {pid}) asks "
                 f"for {mib(extra)} more, which would take it to {mib(using + extra)}, over its "
                 f"cap of {mib(victim.limit_bytes)}")
        try:
            self.kubelet.allocate(pod, victim.container, victim.gpu_uuid, pid, extra, held_by)
        except CapHeld as e:
            self.progress(f"over the cap: {victim.ref}'s process {pid} asked for {mib(extra)} "
                          f"more on GPU {gpu_index}: refused ({e.tier})")
            self.outcome.over_cap_title = HELD
            return [asked, f"{e.tier} -> {e}"]
        except GpuOutOfMemory as e:
            if e.cgroup is not None:  # the driver holds a limit the agent does not report
                raise DemoFailure(f"{victim.ref}'s allocation was refused by a cgroup limit the "
                                  f"node agent does not report (tier {tier}): {e}") from None
            self.outcome.over_cap_title = NOTHING
            return [asked, f"the allocation fails, but not for its cap: {e}"]
        policy = self.s.node_config.watchdog_policy
        self.progress(f"over the cap: {victim.ref}'s process {pid} allocated {mib(extra)} more "
                      f"on GPU {gpu_index}; no hard limit stops it")
        try:
            if "watchdog" in held_by and policy is WatchdogPolicy.KILL:
                return self._stopped(victim, uid, pid, asked)
            return self._uncapped(asked, held_by)
        finally:
            self.s.nvml.free(pid, victim.gpu_uuid, extra)

    def _event(self, row: Row, uid: str, reasons: tuple[str, ...], what: str) -> Any:
        def event() -> Any:
            items = self.core.list_namespaced_event(row.namespace).items
            return next((e for e in items if e.reason in reasons
                         and e.involved_object.uid == uid), None)

        return _wait(what, event)

    def _stopped(self, victim: Row, uid: str, pid: int, asked: str) -> list[str]:
        """A `kill` watchdog, the container's only tier that acts on it: the stop's outcome
        (LimitEnforced, or ProcessNotStopped for one still running after SIGKILL) on its pod."""
        found = self._event(victim, uid, (ev.LIMIT_ENFORCED, ev.PROCESS_NOT_STOPPED),
                            f"the watchdog's LimitEnforced event on {victim.ref} (its process "
                            "went over the cap, no hard tier stopped it, and the policy is kill)")
        recorded = pid in (self.s.killer.calls if self.s.killer is not None else ())
        self.outcome.over_cap_title = CAUGHT
        return [
            f"{asked}: the allocation succeeds, no hard limit stops it",
            f"watchdog (policy kill) -> Event {found.type} {found.reason} on pod "
            f"{victim.namespace}/{victim.pod}: {found.message}",
            "simulated: the demo's process killer "
            + (f"recorded the stop of pid {pid}" if recorded else "was not asked to stop it")
            + " and sent no signal (the demo's GPU processes exist only in the simulated NVML "
            "and /proc), so the process still runs and the demo frees what it asked for; on a "
            "node the agent sends SIGTERM, and SIGKILL 5 s later",
        ]

    def _uncapped(self, asked: str, held_by: frozenset[str]) -> list[str]:
        """Nothing the agent reports in force for the row caps it (it never applies a container
        so, nor publishes a `report` watchdog as a limit in force): said as it is."""
        self.outcome.over_cap_title = NOTHING
        return [f"{asked}: the allocation succeeds and nothing stops it: no limit the node "
                f"agent reports in force for it ({', '.join(sorted(held_by)) or 'none'}) caps it"]

    # -- 7. the rejection ----------------------------------------------------------------------

    def reject(self) -> list[str]:
        gpu = self.s.nvml.gpus[0].uuid
        manifest = forged_gpu_pod(self.s.config.namespace, gpu)
        admitted = admit(manifest, admission_config(self.s.keys))
        meta = manifest["metadata"]
        if admitted.allowed:
            raise DemoFailure(f"admission let pod {meta['namespace']}/{meta['name']} pick its "
                              "own GPU")
        d = admitted.decision
        return [f"pod {meta['namespace']}/{meta['name']} (created by {USER}, sets the binder's "
                f"key itself): {d.code} {d.reason}: {d.message}"]

    # -- --keep: a pod for the user's first MirrorAllocation -------------------------------------

    def first_call(self) -> FirstCall:
        """Admit and create the first-call pod, Pending and not bound; size it with
        PreviewAllocation and pick the GPU the demo's scheduler would give it (booked, so a
        second look does not hand it out again); the MirrorAllocation is left to the user."""
        namespace = self.s.config.namespace
        admitted = admit(first_call_manifest(namespace), admission_config(self.s.keys))
        if not admitted.allowed or admitted.pod is None:
            raise DemoFailure(f"admission refused the first-call pod: {admitted.decision.message}")
        pod = self.core.api_client.sanitize_for_serialization(
            self.core.create_namespaced_pod(namespace, admitted.pod))
        share = _share(pod, self.s)
        assert share is not None and self.placer is not None
        slots = list(self.placer.gpus)
        preview = self.s.stub.PreviewAllocation(pb.PreviewAllocationRequest(
            allocation=allocation(pod, share, self.node, [slots[0].uuid])), timeout=10)
        ref = f"{namespace}/{pod['metadata']['name']}"
        chosen = self.placer.place(Ask(ref, share.compute_mode, request_mib(preview)))
        gpu = chosen[0] if not isinstance(chosen, str) else slots[0]
        request = pb.MirrorAllocationRequest(
            allocation=allocation(pod, share, self.node, [gpu.uuid]),
            idempotency_key=idempotency_key(pod))
        self.progress(f"first call: created {ref} (Pending, not bound) for a MirrorAllocation "
                      f"by hand on GPU {gpu.index}")
        return FirstCall(namespace=namespace, name=pod["metadata"]["name"],
                         uid=pod["metadata"]["uid"], node=self.node, gpu_index=gpu.index,
                         gpu_uuid=gpu.uuid, fits=not isinstance(chosen, str), request=request)

    # -- all of it -----------------------------------------------------------------------------

    def run(self, examples: list[DemoPod] | None = None) -> Outcome:
        """The story; `examples` as `load_examples` reads them (by default it reads the
        config's directory here)."""
        s = self.s
        if examples is None:
            examples = load_examples(s.config.examples, s.config.namespace)
        self.progress(f"{len(examples)} pods from {s.config.examples}")
        created = self.create(examples)
        bound = self.schedule(created)
        running = self.start_pods(bound)
        expected = self.start_processes(running)
        _wait("the node agent to report the simulated processes' memory",
              lambda: self._agent_sees(expected))
        # The agent publishes its node condition on its own schedule; a report read before it
        # would say that no agent reported from this node.
        _wait(f"the node agent's {k.NODE_CONDITION} condition on node {self.node}",
              self._condition_published)
        report = self.outcome.report = self.report()
        self.print_report(report)
        self.outcome.violation = self.violate(report)
        # The extra memory is freed: leave the node as the table shows it (for --keep).
        _wait("the node agent to see the container back under its cap",
              lambda: self._agent_sees(expected))
        self._section(self.outcome.over_cap_title, self.outcome.violation)
        self.outcome.rejection += self.reject()
        self._section("Rejected by admission", self.outcome.rejection)
        return self.outcome

    def print_report(self, report: Report) -> None:
        self.out.write(
            f"kai-fractions demo: {len({r.ref for r in report.rows})} fractional containers from "
            f"{self.s.config.examples.name}/ on node {self.node} "
            f"({gpu_summary(self.s.nvml.gpus)}, simulated)\n\n")
        self.out.write(table(report))
        self.out.flush()
        warned = rowless(report, self.outcome.warned, self.outcome.sources)
        if warned:
            self._section("Admitted with warnings", warned)

    def _section(self, title: str, lines: list[str]) -> None:
        self.out.write(f"\n{title}:\n")
        for line in lines:
            self.out.write(f"  {line}\n")
        self.out.flush()

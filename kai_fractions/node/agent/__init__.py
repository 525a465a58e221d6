"""The node agent: watches the pods bound to its node and keeps the GPUs converged with them.

One process per GPU node (`kai-fractions node-agent`, a DaemonSet). Threads and who owns what:

- the pod watcher (`watch.py`) lists and watches the node's pods into a `PodCache`;
- ONE worker (`worker.py`) owns the engine, NVML and the MPS control: every reconcile pass, every
  watchdog check and every gRPC call that touches the GPUs runs there, one at a time (the engine
  is not thread-safe), fed by a coalescing "dirty" flag;
- the condition publisher (`status_publisher.py`) patches the node condition and its heartbeat
  from a snapshot the worker leaves behind, so a stuck worker is still reported (NotReconciling);
- the metrics HTTP server and the gRPC server (`grpc_service.py`, behind the caller check of
  `peer_guard.py`) read snapshots only.

Kubernetes sits behind `kube.py` (over `kai_fractions.kube`, whose `BlockingKube` runs the
requests and the watch on an event loop of its own thread; in memory for tests:
tests/support/fake_kube.py).
"""

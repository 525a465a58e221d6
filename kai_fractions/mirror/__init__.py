"""The allocation mirror: a scheduler's decision becomes the pod's NvFractions annotations.

The core, independent of gRPC:
- `service.MirrorService`: mirror / preview / release over a `store.PodStore` (coroutines);
  `compute` is the pure part (which keys are the user's, what to write, the one patch),
  `record` the `kai-fractions.io/mirrored` record of what the mirror wrote, `errors` why a call
  failed, as values.
- `decision.AllocationInput` -> contract `BindDecision` (`resolve_decision`), the one place
  that reads a scheduler's values.
- `kube_store.KubePodStore`: the store over `kai_fractions.kube` (the tests' in-memory one is
  tests/support/fake_store.py).
- `pod_cache`: the cache of Pending pods, a data structure (what each entry keeps:
  `pod_trimming`); `pod_feed` feeds it from a list +
  watch (`kai_fractions.kube.listwatch`) on the serving event loop, where `foreground` lets the
  calls go before the list's work and a burst of the watch's events.

Its faces:
- `grpc`: the kai_fractions.v1.AllocationMirror service (grpc.aio, one event loop) with health,
  reflection, TLS / mutual TLS and a bearer token: `grpc.server`, `grpc.servicer`
  (MirrorService's values and errors -> protobuf and gRPC status: `grpc.proto`, `grpc.status`),
  `grpc.security`.
- `follower`, `bindrequests`, `leader`: the KAI follower (`--follow-bindrequests`), one replica
  at a time (`--leader-elect`); `kai_binder` what KAI's binder writes, `rechecks` when an
  incomplete check is done again; `public_key`, `kai_dependency`: what the mirror publishes.

See docs/mirror.md and docs/architecture.md.
"""

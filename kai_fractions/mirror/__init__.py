"""The allocation mirror: a scheduler's decision becomes the pod's NvFractions annotations.

- `service.MirrorService`: mirror / preview / release over a `store.AsyncPodStore` (coroutines,
  independent of gRPC); `compute` is the pure part (which keys are the user's, what to write,
  the one patch), `record` the `kai-fractions.io/mirrored` record of what the mirror wrote.
- `decision.AllocationInput` -> contract `BindDecision` (`resolve_decision`), the one place
  that reads a scheduler's values.
- `aio_store.AsyncKubePodStore`: the service's store on the event loop, over `aio_api` (the
  official client's configuration and credentials) and `http1` (the loop's own connections);
  `kube_api`: the requests and what their refusals mean, for both stores.
- `kube_store.KubePodStore` (official client, blocking: the follower's, and the service's behind a
  proxy through `store.ThreadedPodStore`); the tests' in-memory one is tests/support/fake_store.py.
- `pod_cache`, `aio_listwatch`, `listwatch`: the cache of Pending pods and the list + watch loops
  that feed it (on the event loop) and the follower (in a thread).
- `grpc`: the mirror's gRPC face, the kai_fractions.v1.AllocationMirror service (grpc.aio, one
  event loop) with health, reflection, TLS / mutual TLS and a bearer token: `grpc.server`,
  `grpc.servicer` (MirrorService's values and errors -> protobuf and gRPC status: `grpc.proto`,
  `grpc.status`), `grpc.security`.
- `follower`, `bindrequests`: the KAI follower (`--follow-bindrequests`).

See docs/mirror.md.
"""

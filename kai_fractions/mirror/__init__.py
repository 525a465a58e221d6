"""The allocation mirror: a scheduler's decision becomes the pod's NvFractions annotations.

- `service.MirrorService`: mirror / preview / release over a `store.PodStore` (gRPC-agnostic);
  `compute` is the pure part (which keys are the user's, what to write, the one patch),
  `record` the `kai-fractions.io/mirrored` record of what the mirror wrote.
- `decision.AllocationInput` -> contract `BindDecision` (`resolve_decision`), the one place
  that reads a scheduler's values.
- `kube_store.KubePodStore` (official client, bounded jittered retries) and
  `fake_store.FakePodStore` (in memory, for tests).
- `servicer`, `status`, `proto`, `security`, `server`: the kai_fractions.v1.AllocationMirror
  gRPC service with health, reflection, TLS / mutual TLS and a bearer token.
- `follower`, `bindrequests`: the KAI follower (`--follow-bindrequests`).

See docs/mirror.md.
"""

"""`kai-fractions demo`: the whole system on one machine, with simulated GPUs.

- `config`: the simulated node from a small YAML file (`--config`);
- `session`: starts and stops the API, the real mirror gRPC server and the real node agent on
  the simulated node (the simulators of `kai_fractions.sim`: the embedded Kubernetes API,
  FakeNvml at the NVML seam, FakeMpsControl, FakeCgroupFs);
- `workloads`: the example pods (one per workload) and a manifest admission must refuse;
- `admission_step`: the webhooks' review functions as the API server would call them;
- `scheduler`: a deterministic stand-in for KAI (PreviewAllocation, place, MirrorAllocation,
  bind);
- `kubelet`: the pod statuses, the real gate loop, simulated GPU processes and their
  allocations (refused by a hard tier the agent reports in force, or a full GPU, as CUDA
  would be);
- `scenario`: the story, printed with the `inspect` report (its TIER column: which memory tier
  holds each row's cap);
- `first_call`: `--keep`'s Pending pod and the commands for a first MirrorAllocation on it.
"""

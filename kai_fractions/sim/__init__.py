"""Simulators the embedded demo ships: a simulated NVML (`nvml`, with
`nvml_controls` and `nvml_records`), MPS control daemon and its
supervisor (`mps`), cgroup filesystem (`cgroups`), process killer (`killer`) and Kubernetes API
server (`apiserver`, needs the `demo` extra).

They stand in for the GPU node and the cluster so that `kai-fractions demo` runs the real mirror
and node agent on a laptop; the tests use them too. Not for production: nothing here touches a
GPU, a process or a real cluster.
"""

"""Test support: real tools and fakes, with their pytest fixtures.

* ``tools``     - paths of .tools/ binaries (scripts/test-tools.sh); fixtures ``tool_paths``,
  ``helm_bin``, ``kubectl_bin``, ``grpcurl_bin``, ``buf_bin``.
* ``fake_nvml`` - the fake libnvidia-ml.so.1 for the real pynvml; fixtures ``fake_nvml``,
  ``fake_nvml_old_driver``.
* ``mps``       - the real nvidia-cuda-mps-control daemon; fixture ``mps_daemon``.
* ``kube``      - kmock Kubernetes API + official sync client; fixture ``kube``.
* ``fake_kube`` - an in-memory cluster behind the node agent's Kubernetes seams (``FakeCluster``).
* ``fake_store`` - an in-memory PodStore for the mirror (``FakePodStore``).

Fixture modules are registered in tests/conftest.py (``pytest_plugins``).
"""

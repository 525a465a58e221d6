"""Test support: real tools and fakes, with their pytest fixtures.

* ``tools``     - paths of .tools/ binaries (scripts/test-tools.sh); fixtures ``tool_paths``,
  ``helm_bin``, ``kubectl_bin``, ``grpcurl_bin``, ``buf_bin``.
* ``fake_nvml`` - the fake libnvidia-ml.so.1 for the real pynvml; fixtures ``fake_nvml``,
  ``fake_nvml_old_driver``.
* ``mps``       - the real nvidia-cuda-mps-control daemon; fixture ``mps_daemon``.
* ``kube``      - kmock Kubernetes API + official sync client; fixture ``kube``.

Fixture modules are registered in tests/conftest.py (``pytest_plugins``).
"""

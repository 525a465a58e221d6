"""Shared pytest setup: fixtures live in modules under tests/support/ and are registered here.

Add new fixture modules to ``pytest_plugins``; keep this file free of fixtures itself.
"""

pytest_plugins = [
    "tests.support.tools",
    "tests.support.fake_nvml",
    "tests.support.mps",
    "tests.support.kube",
    "tests.support.mirror_kube",
    "tests.support.faults_api",
    "tests.support.agent_process",
]

"""Issue 17, finding 5: one malformed annotation must not stop a node.

A pod in a namespace the webhook skips carried a 5000-digit `gpu-fraction`; Python's int-digit
limit raised a plain ValueError out of the contract, every reconcile pass failed and valid pods
never got their marker. Now every parser answers with the contract's own error, lengths are
bounded before any conversion, and the agent plans each pod on its own.
"""

from __future__ import annotations

import pytest

from kai_fractions.contract import parse_pod, pod_views
from tests.agent.test_agent_process import (
    CONTAINER_HEX,
    binder_keys,
    pod_body,
    ready,
    start_running,
)
from tests.support.agent_process import GPU0, H100_MIB, AgentEnv, wait_for

HUGE = "1" * 5000


@pytest.mark.parametrize("annotations", [
    {"gpu-fraction": HUGE}, {"gpu-fraction": "0." + HUGE}, {"gpu-memory": HUGE},
    {"gpu-fraction-num-devices": HUGE, "gpu-fraction": "0.5"},
    {"gpu-fraction": "0.5", "kai.scheduler/container.main.gpu-memory.portion.limit": HUGE},
    {"nvidia.com/container.main.gpu-memory.request": HUGE + "Gi"},
    {"nvidia.com/container.main.gpu-memory.request": "1Gi",
     "nvidia.com/container.main.gpu-compute.portion": HUGE},
    {"nvidia.com/container.main.gpu-memory.request": "1Gi",
     "nvidia.com/container.main.gpus.devices": ",".join(["GPU-0a"] * 5000)},
])
def test_every_parser_answers_with_a_contract_error_of_bounded_length(annotations):
    body = pod_body("bad", annotations, None)
    request = parse_pod(next(pod_views(body)))
    assert request.errors
    assert all(len(str(e)) < 400 for e in request.errors)


@pytest.mark.integration
def test_a_pod_with_a_5000_digit_fraction_does_not_stop_the_node(agent_env: AgentEnv) -> None:
    env = agent_env
    env.nvml.add_gpu(GPU0, memory_mib=H100_MIB)
    env.create_node()
    run = env.start(sm_sharing=False)
    wait_for(lambda: ready(env), what="node condition True", run=run, timeout=20)
    bad = env.kube.core.create_namespaced_pod("default", pod_body(
        "bad", {**binder_keys("time-slicing"), "gpu-fraction": HUGE}, env.node))
    good = env.kube.core.create_namespaced_pod(
        "default", pod_body("good", binder_keys("time-slicing"), env.node))
    for created in (bad, good):
        start_running(env, created.metadata.uid, *env.make_cgroups(created.metadata.uid,
                                                                   CONTAINER_HEX))
    wait_for(lambda: env.marker(good.metadata.uid).exists(), run=run, what="good marker",
             timeout=20)
    wait_for(lambda: [e for e in env.kube.core.list_namespaced_event("default").items
                      if e.involved_object.name == "bad" and e.reason == "Refused"],
             run=run, what="an event on the bad pod", timeout=20)
    events = [e for e in env.kube.core.list_namespaced_event("default").items
              if e.involved_object.name == "bad" and e.reason == "Refused"]
    assert "gpu-fraction" in events[0].message and len(events[0].message) < 1024
    assert run.stop() == 0

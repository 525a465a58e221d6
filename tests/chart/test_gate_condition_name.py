"""The admission server is told the node condition the chart's node agents publish
(`nodeCondition.name`), so the gate it wires into each fractional pod names that condition where
it says the agent's reason is. Before, only the node agents and the mirror were told: the gate
named gpu-fractioning.nvidia.com/Ready, missing on every node of a cluster that renamed it."""

from __future__ import annotations

from kai_fractions.cli import build_parser

from .render import container, one, render

ADMISSION = "kai-fractions-admission"
AGENT = "kai-fractions-node-agent"
RENAMED = "example.com/Ready"


def admission_args(*sets: str) -> list[str]:
    return container(one(render(sets=sets), "Deployment", ADMISSION), "admission")["args"]


def test_a_renamed_node_condition_reaches_the_admission_server() -> None:
    args = admission_args(f"nodeCondition.name={RENAMED}")
    assert f"--condition-name={RENAMED}" in args
    assert build_parser().parse_args(args).condition_name == RENAMED
    agent = container(one(render(sets=(f"nodeCondition.name={RENAMED}",)), "DaemonSet", AGENT),
                      "node-agent")["args"]
    assert f"--condition-name={RENAMED}" in agent  # the condition the gate names is published


def test_the_default_node_condition_reaches_it_too() -> None:
    args = admission_args()
    assert "--condition-name=gpu-fractioning.nvidia.com/Ready" in args
    assert build_parser().parse_args(args).condition_name == "gpu-fractioning.nvidia.com/Ready"

"""`kai-fractions plan --node-gpu-memory` has the mirror's bound (2^40 MiB) and says it in the
mirror's words: a preview must not accept a node the mirror would refuse."""

from __future__ import annotations

import pytest

from .helpers import GPU_A, cli, data

BOUND = 1 << 40


@pytest.mark.parametrize("mib", [BOUND + 1, 10**20])
def test_more_than_the_mirrors_bound_is_refused_naming_the_flag(capsys, mib: int):
    code, out, err = cli(capsys, "plan", "-f", data("valid-pod.yaml"), "--node-gpu-memory",
                         str(mib), "--devices", GPU_A)
    assert (code, out) == (2, "")
    assert err == (f"kai-fractions plan: --node-gpu-memory: must be at most 1099511627776 MiB, "
                   f"got {mib}\n")


def test_the_bound_itself_is_planned(capsys):
    code, out, _ = cli(capsys, "plan", "-f", data("valid-pod.yaml"), "--node-gpu-memory",
                       str(BOUND), "--devices", GPU_A)
    assert code == 0 and out


def test_the_mirror_says_the_same_of_a_request():
    from kai_fractions.mirror.decision import MAX_NODE_GPU_MEMORY_MIB

    assert MAX_NODE_GPU_MEMORY_MIB == BOUND

"""The node agent with a fractional container whose name is too long to be its own id in the
derived keys (KAI takes names up to 33 characters; ours leave room for 24): the annotations it
writes are keys Kubernetes accepts, under the container's shortened id; it reads its applied
plan back from them after a restart (no second patch), and the gate releases the container."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.gate.check import Outcome, judge
from kai_fractions.marker import read_marker

from .builders import CID, Rig, binder_annotations, pod

NAME = "tensorrt-llm-inference-server"  # 29 characters
_KEY_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def is_valid_key(key: str) -> bool:
    name = key.rpartition("/")[2]
    return len(name) <= 63 and _KEY_NAME.fullmatch(name) is not None


def add_long_named_pod(rig: Rig, mode: str) -> str:
    manifest = pod("llm-0", notes=binder_annotations(NAME, devices=rig.gpu0, mode=mode))
    manifest["spec"]["containers"] = [{"name": NAME, "image": "x"}]
    manifest["status"]["containerStatuses"] = [{"name": NAME, "containerID": CID}]
    return rig.add(manifest)["metadata"]["uid"]


@pytest.mark.parametrize("mode", ["sm-sharing", "time-slicing"])
def test_the_agent_writes_valid_keys_and_reads_them_back(short_tmp: Path, mode: str) -> None:
    rig = Rig(short_tmp)
    uid = add_long_named_pod(rig, mode)
    assert rig.step().converged
    (patched_uid, patch), = rig.cluster.annotation_patches
    assert patched_uid == uid
    assert [key for key in patch if not is_valid_key(key)] == []
    suffixes = [".memory-request-mib", ".memory-limit-mib", ".mps-pinned-mem-limit",
                ".plan-digest"]
    if mode == "sm-sharing":
        suffixes += [".mps-active-thread-percentage", ".mps-pipe-directory"]
    assert sorted(patch) == sorted(DEFAULT_KEYS.derived(NAME, s) for s in suffixes)
    notes = rig.cluster.pods[uid]["metadata"]["annotations"]
    verdict = judge(notes, read_marker(rig.marker_path(uid).parent), pod_uid=uid,
                    keys=DEFAULT_KEYS, boot_id=rig.reconciler.markers.boot_id,
                    containers=[NAME])
    assert verdict.outcome is Outcome.RELEASE, verdict.message
    # A new agent finds the plan it applied in those keys: nothing to patch again.
    rig.cluster.annotation_patches.clear()
    restarted = rig.restarted()
    assert restarted.step(full=True).converged
    assert rig.cluster.annotation_patches == []
    assert rig.cluster.event_reasons(uid) == ["Applied"]

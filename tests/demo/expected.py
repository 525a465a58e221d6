"""What the demo must print, computed here from examples/ with the contract package alone.

The placement is written down by hand from the demo's rule (pods in file order, first GPU(s)
in index order that run the pod's compute mode or nothing and have its request free of the
GPU's memory; upstream KAI main subtracts no reserve): on 2 x H100 80GB the five time-slicing
pods fill GPU 0, sm-sharing takes GPU 1, and the two-GPU fraction finds only one time-slicing
GPU with room. The numbers are the binder arithmetic and the node plan of the contract package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import yaml

from kai_fractions.contract import (
    BindDecision,
    ContainerView,
    PodView,
    binder_annotations,
    parse_pod,
    plan_container,
    pod_views,
)
from kai_fractions.sim.nvml import fake_uuid

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NODE = "demo-node"
H100_MIB = 81559  # what NVML reports for an H100 80GB HBM3, and so the node label
RESERVE_MIB = 0  # upstream KAI main's binder subtracts no reserve (the demo's default)
PLACEMENT = {  # pod -> GPU indexes; None: not schedulable
    "gpu-fraction-with-limit": (0,),
    "llm-inference-0": (0,),
    "embeddings-batch-0": (0,),
    "memory-request": (0,),
    "multi-device-fraction": None,
    "request-and-limit": (0,),
    "sm-sharing": (1,),
}
MIB = 1024 * 1024


@dataclass(frozen=True)
class Expected:
    pod: str
    container: str
    gpus: tuple[int, ...] | None
    mode: str
    request_mib: int | None
    limit_mib: int | None
    atp: int | None

    @property
    def ref(self) -> str:
        return f"default/{self.pod}/{self.container}"

    @property
    def used_mib(self) -> int:
        assert self.request_mib is not None
        return self.request_mib * 3 // 4


def gpu_uuid(index: int) -> str:
    return fake_uuid(NODE, index)


def expected_rows(gpu_count: int = 2, placement=PLACEMENT) -> list[Expected]:
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            for view in pod_views(doc or {}):
                share = parse_pod(view).share
                if share is None:
                    continue
                name = view.name if view.kind == "Pod" else f"{view.name}-0"
                gpus = placement[name]
                if gpus is None:
                    out.append(Expected(name, share.container, None,
                                        share.compute_mode.value, None, None, None))
                    continue
                uuids = tuple(gpu_uuid(i) for i in gpus)
                decision = BindDecision(
                    node_gpu_memory_mib=H100_MIB, gpu_ids=uuids,
                    received_portion=share.fraction,
                    group_modes=(share.compute_mode,) * len(uuids), reserve_mib=RESERVE_MIB)
                annotations = {**view.annotations,
                               **binder_annotations(parse_pod(view), decision)}
                bound = PodView(name=name, uid="00000000-0000-4000-8000-000000000000",
                                annotations=MappingProxyType(annotations),
                                containers=tuple(ContainerView(c.name)
                                                 for c in view.containers))
                plan = plan_container(parse_pod(bound).share, bound.uid)
                out.append(Expected(name, share.container, gpus, plan.compute_mode.value,
                                    plan.request_mib, plan.limit_mib,
                                    plan.active_thread_percentage))
    return out


# -- reading the demo's table --------------------------------------------------------------------

_GPU = re.compile(r"GPU (\d+)  (GPU-[0-9a-f-]+)  (.+?)  (\d+) MiB  (\S+)  requested (\d+) MiB")


def parse_tables(text: str) -> tuple[dict[int, tuple[str, str, list[list[str]]]],
                                     list[list[str]], list[str]]:
    """({gpu index: (uuid, mode, rows)}, unplaced rows, `!` reason lines); each row is the
    columns POD/CONTAINER, MODE, REQUEST, LIMIT, ATP, USED, STATE, TIER. The demo's admission
    warnings are not reasons: `admission_warnings` reads them."""
    gpus: dict[int, tuple[str, str, list[list[str]]]] = {}
    unplaced: list[list[str]] = []
    reasons: list[str] = []
    current: list[list[str]] | None = None
    for line in text.splitlines():
        m = _GPU.match(line)
        if m:
            current = []
            gpus[int(m.group(1))] = (m.group(2), m.group(5), current)
            continue
        if line == "not on a GPU:":
            current = unplaced
            continue
        if not line.strip() or not line.startswith("  "):
            current = None if not line.startswith("  ") else current
            continue
        if current is None:
            continue
        if line.startswith("  ! "):
            if ADMISSION_WARNING not in line:
                reasons.append(line[4:])
        elif not line.strip().startswith("POD/CONTAINER"):
            current.append(re.split(r"\s{2,}", line.strip()))
    return gpus, unplaced, reasons


ADMISSION_WARNING = ": admission warning: "


def admission_warnings(text: str) -> dict[str, list[str]]:
    """The demo's `! <ref>: admission warning: ...` lines (without `  ! `), per table block: the
    GPU's heading (`GPU 0`) or `not on a GPU`."""
    found: dict[str, list[str]] = {}
    block = ""
    for line in text.splitlines():
        m = _GPU.match(line)
        if m or line == "not on a GPU:":
            block = f"GPU {m.group(1)}" if m else "not on a GPU"
        elif line.startswith("  ! ") and ADMISSION_WARNING in line:
            found.setdefault(block, []).append(line[4:])
    return found


def row_cells(e: Expected, state: str = "enforced", tier: str = "cgroup") -> list[str]:
    atp = "-" if e.atp is None else f"{e.atp}%"
    return [e.ref, e.mode, f"{e.request_mib} MiB", f"{e.limit_mib} MiB", atp,
            f"{e.used_mib} MiB", state, tier]

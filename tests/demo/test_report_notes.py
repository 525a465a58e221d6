"""`demo.report_notes`: a pod's admission warnings go under its first row only."""

from __future__ import annotations

from kai_fractions.demo.report_notes import annotated
from kai_fractions.inspect.model import Gpu, Report, Row


def row(container: str, gpu: str) -> Row:
    return Row(namespace="default", pod="p", container=container, gpu_uuid=gpu,
               mode="time-slicing", request_bytes=1, limit_bytes=1,
               active_thread_percentage=None, devices=(gpu,), state="enforced")


def test_a_pod_of_several_rows_gets_its_warnings_once() -> None:
    """A second look found a pod's one warning printed under every row of the pod (each
    container, each GPU): three copies for a two-container pod on two GPUs."""
    report = Report(title="node", gpus=(
        Gpu(uuid="GPU-0", rows=(row("a", "GPU-0"), row("b", "GPU-0"))),
        Gpu(uuid="GPU-1", rows=(row("a", "GPU-1"),))))
    out = annotated(report, {"default/p": ("W1",)}, bound=())
    assert [w for g in out.gpus for r in g.rows for w in r.warnings] == [
        "admission warning: W1"]

"""The demo's pure parts: placement, the example pods, the downward-API file, the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from kai_fractions.contract import ComputeMode, Dialect
from kai_fractions.demo.config import DemoConfig, DemoConfigError, config_from_dict, load_config
from kai_fractions.demo.kubelet import container_id, downward_annotations
from kai_fractions.demo.scheduler import Ask, GpuSlot, Placer
from kai_fractions.demo.workloads import WorkloadError, load_examples, pod_of
from kai_fractions.gate import parse_annotations

from .expected import EXAMPLES

TS, SM = ComputeMode.TIME_SLICING, ComputeMode.SM_SHARING


def test_placer_fills_in_index_order_one_mode_per_gpu():
    placer = Placer([GpuSlot(0, "GPU-a", 100), GpuSlot(1, "GPU-b", 100)])
    assert [g.index for g in placer.place(Ask("ns/a", TS, 60))] == [0]
    assert [g.index for g in placer.place(Ask("ns/b", TS, 40))] == [0]
    assert [g.index for g in placer.place(Ask("ns/c", SM, 10))] == [1]
    # Each GPU's own blocker: GPU 0 runs the right mode but is full, GPU 1 runs another mode.
    assert placer.place(Ask("ns/d", TS, 1)) == (
        "ns/d needs 1 GPU(s) with 1 MiB free that run time-slicing or nothing yet; 0 of 2 fit "
        "(GPU 0: only 0 MiB free; GPU 1: runs sm-sharing)")
    assert placer.place(Ask("ns/d", SM, 95)) == (
        "ns/d needs 1 GPU(s) with 95 MiB free that run sm-sharing or nothing yet; 0 of 2 fit "
        "(GPU 0: runs time-slicing, and only 0 MiB free; GPU 1: only 90 MiB free)")
    assert [g.index for g in placer.place(Ask("ns/e", SM, 90))] == [1]
    assert placer.used == {"GPU-a": 100, "GPU-b": 100}


def test_placer_multi_device():
    placer = Placer([GpuSlot(i, f"GPU-{i}", 100) for i in range(3)])
    placer.place(Ask("ns/a", SM, 10))
    assert [g.index for g in placer.place(Ask("ns/b", TS, 50, count=2))] == [1, 2]
    assert isinstance(placer.place(Ask("ns/c", TS, 60, count=2)), str)


def test_placer_names_memory_not_mode_when_memory_blocks():
    """The demo's own case: a two-GPU fraction, one GPU too full, the other empty."""
    placer = Placer([GpuSlot(0, "GPU-a", 100), GpuSlot(1, "GPU-b", 100)])
    placer.place(Ask("ns/a", TS, 70))
    message = placer.place(Ask("ns/b", TS, 50, count=2))
    assert message == ("ns/b needs 2 GPU(s) with 50 MiB free that run time-slicing or nothing "
                       "yet; 1 of 2 fit (GPU 0: only 30 MiB free; GPU 1: fits (100 MiB free))")
    assert "compute mode" not in message and "runs" not in message


def test_example_pods():
    pods = load_examples(EXAMPLES, "team-x")
    assert [(p.namespace, p.name, p.source) for p in pods] == [
        ("team-x", "gpu-fraction-with-limit", "gpu-fraction-with-limit.yaml"),
        ("team-x", "llm-inference-0", "inference-deployment.yaml (Deployment llm-inference)"),
        ("team-x", "embeddings-batch-0", "job.yaml (Job embeddings-batch)"),
        ("team-x", "memory-request", "memory-request.yaml"),
        ("team-x", "multi-device-fraction", "multi-device-fraction.yaml"),
        ("team-x", "request-and-limit", "request-and-limit.yaml"),
        ("team-x", "sm-sharing", "sm-sharing.yaml"),
    ]
    llm = pods[1].manifest
    assert llm["metadata"]["annotations"] == {
        "nvidia.com/container.vllm.gpu-memory.request": "20Gi",
        "nvidia.com/container.vllm.gpu-memory.limit": "24Gi"}
    assert llm["spec"]["containers"][0]["name"] == "vllm"


def test_cronjob_template_and_kinds_without_pods():
    cron = {"kind": "CronJob", "metadata": {"name": "nightly"}, "spec": {"jobTemplate": {
        "spec": {"template": {"metadata": {"labels": {"a": "b"}},
                              "spec": {"containers": [{"name": "c"}]}}}}}}
    pod, note = pod_of(cron, "default")
    assert (pod["metadata"], note) == ({"labels": {"a": "b"}, "name": "nightly-0",
                                        "namespace": "default"}, "CronJob nightly")
    assert pod_of({"kind": "Queue", "metadata": {"name": "q"}}, "default") is None


def test_example_errors(tmp_path: Path):
    with pytest.raises(WorkloadError, match="no such directory"):
        load_examples(tmp_path / "none")
    (tmp_path / "a.yaml").write_text("kind: Pod\nmetadata: {name: x}\n---\n"
                                     "kind: Pod\nmetadata: {name: x}\n")
    with pytest.raises(WorkloadError, match="more than one pod named default/x"):
        load_examples(tmp_path)


def test_downward_file_reads_back_through_the_gate():
    annotations = {"b": 'quote " and \\ backslash', "a": "line\nbreak\ttab", "c": "ünïcode"}
    text = downward_annotations(annotations)
    assert text.splitlines()[0] == 'a="line\\nbreak\\ttab"'
    assert parse_annotations(text) == annotations


def test_container_ids_are_stable_and_well_formed():
    cid = container_id("uid-1", "main")
    assert cid == container_id("uid-1", "main") != container_id("uid-1", "other")
    assert cid.startswith("containerd://") and len(cid) == len("containerd://") + 64


def test_config_defaults_and_reserve():
    # Upstream KAI main subtracts no reserve; an explicit one simulates a patched KAI.
    assert (DemoConfig().mirror_reserve_mib, DemoConfig().dialect) == (0, Dialect.UPSTREAM)
    assert config_from_dict({"sm_sharing": False}).mirror_reserve_mib == 0
    patched = config_from_dict({"reserve_mib": 1024})
    assert (patched.mirror_reserve_mib, patched.dialect) == (1024, Dialect.PATCHED)
    nvml = config_from_dict({"gpus": [{"model": "A100-40GB", "count": 3}]}).nvml()
    assert [g.name for g in nvml.gpus] == ["NVIDIA A100-SXM4-40GB"] * 3


def test_config_file(tmp_path: Path):
    path = tmp_path / "demo.yaml"
    path.write_text("node: gpu-7\nexamples: manifests\nmemory_enforcement: [cgroup]\n")
    config = load_config(path)
    assert (config.node, config.examples, config.memory_enforcement) == (
        "gpu-7", tmp_path / "manifests", "cgroup")
    path.write_text("node: [1\n")
    with pytest.raises(DemoConfigError, match=f"^{path}: not valid YAML: "):
        load_config(path)
    path.write_bytes(b"node: \xff\xfe\n")  # not text: an error naming the file, no traceback
    with pytest.raises(DemoConfigError, match=f"^{path}: cannot read: not UTF-8 text"):
        load_config(path)


@pytest.mark.parametrize("data, error", [
    ({"node": "Demo_Node"}, "node: must be a DNS-1123 subdomain (lower-case letters, digits, "
                            "'-' and '.'; each dot-separated part starts and ends with a letter "
                            "or digit), at most 63 characters, got 'Demo_Node'"),
    ({"sm_sharing": "yes"}, "sm_sharing: must be true or false, got 'yes'"),
    ({"reserve_mib": -1}, "reserve_mib: must be a whole number of MiB >= 0, got -1"),
    ({"memory_enforcement": "cgroup,magic"},
     "memory_enforcement: --memory-enforcement: unknown mechanism 'magic'; known: cgroup, "
     "mps-pinned, watchdog"),
    ({"watchdog_policy": "stop"}, "watchdog_policy: must be report or kill, got 'stop'"),
    ({"watchdog_policy": "Kill"}, "watchdog_policy: must be report or kill, got 'Kill'"),
    ({"watchdog_policy": True}, "watchdog_policy: must be report or kill, got True"),
    ({"watchdog_policy": None}, "watchdog_policy: must be report or kill, got None"),
    ([1], "the config must be a mapping of the keys node, gpus, driver_version, sm_sharing, "
          "memory_enforcement, watchdog_policy, reserve_mib, namespace, examples"),
])
def test_config_errors(data, error):
    with pytest.raises(DemoConfigError) as e:
        config_from_dict(data)
    assert str(e.value) == error


@pytest.mark.parametrize(("driver", "limits"), [("550.54.15", False), ("535.104.05", False),
                                                ("615.00.00", True), ("620.10.01", True)])
def test_the_simulated_gpus_follow_the_simulated_driver(driver, limits):
    from kai_fractions.node.errors import NvmlFunctionNotFound

    nvml = config_from_dict({"driver_version": driver}).nvml()
    nvml.init()
    gpu = nvml.gpus[0].uuid
    assert nvml.memory_limits_supported() is limits
    if limits:
        nvml.set_memory_limits(gpu, "/pod", 1, 2)
    else:
        with pytest.raises(NvmlFunctionNotFound, match="nvmlDeviceSetMemoryLimits_v1"):
            nvml.set_memory_limits(gpu, "/pod", 1, 2)


def test_an_allocation_over_a_cgroup_hard_limit_fails_and_changes_nothing():
    from kai_fractions.sim.nvml import FakeNvml, GpuOutOfMemory

    mib = 1024 * 1024
    nvml = FakeNvml.simulated(1)
    nvml.init()
    gpu = nvml.gpus[0].uuid
    nvml.add_process(7, gpu, 6 * mib, cgroup="/pod/c1")
    nvml.add_process(8, gpu, 1 * mib, cgroup="/pod/c2")
    nvml.set_memory_limits(gpu, "/pod", 0, 10 * mib)
    nvml.allocate(7, gpu, 3 * mib)  # 10 MiB in the pod: at the limit, not over it
    with pytest.raises(GpuOutOfMemory) as e:
        nvml.allocate(7, gpu, 1)
    assert (e.value.cgroup, e.value.hard, e.value.used) == ("/pod", 10 * mib, 10 * mib)
    assert [p.used_bytes for p in nvml.processes] == [9 * mib, 1 * mib]


# -- values that would leave the demo enforcing nothing are refused, naming the key -------------

UUID_RULE = ("must be a GPU UUID as NVML gives it, GPU- and 8-4-4-4-12 lower-case hex digits "
             "(GPU-d20accf7-5ad8-a5f3-a183-03fac7775c53), got ")
DRIVER_RULE = ("driver_version: must be an NVIDIA driver version, digits and dots such as "
               "615.00.00 or 550.54.15, got ")
LABEL_RULE = ("namespace: must be a DNS-1123 label (lower-case letters, digits and '-', starting "
              "and ending with a letter or digit), at most 63 characters, got ")
SUBDOMAIN_RULE = ("node: must be a DNS-1123 subdomain (lower-case letters, digits, '-' and '.'; "
                  "each dot-separated part starts and ends with a letter or digit), at most 63 "
                  "characters, got ")


@pytest.mark.parametrize("data, error", [
    ({"gpus": [{"mig": "false"}]},
     "gpus: gpus[0].mig: must be true or false (a YAML boolean, unquoted), got 'false'"),
    ({"gpus": [{"count": 1}, {"mig": 1}]},
     "gpus: gpus[1].mig: must be true or false (a YAML boolean, unquoted), got 1"),
    ({"gpus": [{"memory": 1}]}, "gpus: gpus[0].memory: must be at least 1Mi (a bare number is "
                                "bytes: write 80Gi for 80 GiB), got 1"),
    ({"gpus": [{"memory": "1023Ki"}]}, "gpus: gpus[0].memory: must be at least 1Mi (a bare "
                                       "number is bytes: write 80Gi for 80 GiB), got '1023Ki'"),
    ({"reserve_mib": 81559}, "reserve_mib: must be less than the smallest GPU's memory (81559 "
                             "MiB), or nothing is left to share, got 81559"),
    ({"gpus": [{"model": "H100-80GB"}, {"model": "T4"}], "reserve_mib": 20000},
     "reserve_mib: must be less than the smallest GPU's memory (15360 MiB), or nothing is left "
     "to share, got 20000"),
    ({"gpus": [{"uuid": "GPU-abc"}]}, f"gpus: gpus[0].uuid: {UUID_RULE}'GPU-abc'"),
    ({"gpus": [{"uuid": 5}]}, f"gpus: gpus[0].uuid: {UUID_RULE}5"),
    ({"gpus": [{"uuid": "GPU-D20ACCF7-5AD8-A5F3-A183-03FAC7775C53"}]},
     f"gpus: gpus[0].uuid: {UUID_RULE}'GPU-D20ACCF7-5AD8-A5F3-A183-03FAC7775C53'"),
    ({"driver_version": "r550"}, f"{DRIVER_RULE}'r550'"),
    ({"driver_version": "banana"}, f"{DRIVER_RULE}'banana'"),
    ({"driver_version": None}, f"{DRIVER_RULE}None"),
    ({"driver_version": 615}, f"{DRIVER_RULE}615"),
    ({"driver_version": 550.54}, f'{DRIVER_RULE}550.54 (YAML read a number: quote it, "550.54")'),
    ({"namespace": "team.a"}, f"{LABEL_RULE}'team.a'"),
    ({"namespace": "-a"}, f"{LABEL_RULE}'-a'"),
    ({"namespace": 7}, f"{LABEL_RULE}7"),
    ({"namespace": "a" * 64}, f"{LABEL_RULE}'{'a' * 64}'"),
    ({"node": "-demo"}, f"{SUBDOMAIN_RULE}'-demo'"),
    ({"node": "demo..node"}, f"{SUBDOMAIN_RULE}'demo..node'"),
    ({"node": None}, f"{SUBDOMAIN_RULE}None"),
    ({"gpus": [{"count": 100000}]},
     "gpus: gpus[0].count: at most 16 GPUs on the node in all, this entry makes 100000"),
    ({"gpus": [{"count": 8}, {"model": "T4", "count": 9}]},
     "gpus: gpus[1].count: at most 16 GPUs on the node in all, this entry makes 17"),
])
def test_config_values_that_enforce_nothing_are_refused(data, error):
    with pytest.raises(DemoConfigError) as e:
        config_from_dict(data)
    assert str(e.value) == error


def test_config_values_at_the_limits_are_taken():
    config = config_from_dict({
        "node": "gpu-7.rack-2", "namespace": "team-a", "driver_version": "550.54.15",
        "reserve_mib": 15359,
        "gpus": [{"model": "H100-80GB", "count": 15, "mig": False},
                 {"model": "T4", "uuid": "GPU-d20accf7-5ad8-a5f3-a183-03fac7775c53"}]})
    gpus = config.nvml().gpus
    assert len(gpus) == 16 and not any(g.mig for g in gpus)
    assert gpus[-1].uuid == "GPU-d20accf7-5ad8-a5f3-a183-03fac7775c53"
    assert config_from_dict({"gpus": [{"mig": True}]}).nvml().gpus[0].mig is True
    assert config_from_dict({"gpus": [{"name": "Tiny", "memory": "1Mi"}]}).nvml().gpus[0] \
        .memory_total == 1024 * 1024


# -- example manifests the demo cannot create: its error, naming the file and the field ----------

@pytest.mark.parametrize("text, error", [
    ("kind: Pod\nmetadata:\n  generateName: trainer-\nspec: {containers: [{name: c}]}\n",
     "metadata.name: must be a non-empty string, got None (generateName 'trainer-' is not "
     "enough: the demo creates each pod by name)"),
    ("kind: Pod\nmetadata:\nspec: {containers: [{name: c}]}\n",
     "metadata: must be a mapping with a name, got None"),
    ("kind: Pod\nspec: {containers: [{name: c}]}\n",
     "metadata: must be a mapping with a name, got None"),
    ("kind: Pod\nmetadata: {name: 7}\n", "metadata.name: must be a non-empty string, got 7"),
    ("kind: Pod\nmetadata: {name: x, namespace: [a]}\n",
     "metadata.namespace: must be a non-empty string, got ['a']"),
    ("kind: Deployment\nmetadata: {}\nspec: {template: {spec: {containers: [{name: c}]}}}\n",
     "metadata.name: must be a non-empty string, got None"),
])
def test_bad_example_manifests_name_the_file_and_field(tmp_path: Path, text, error):
    (tmp_path / "bad.yaml").write_text(text)
    kind = text.split("\n", 1)[0].removeprefix("kind: ")
    with pytest.raises(WorkloadError) as e:
        load_examples(tmp_path)
    assert str(e.value) == f"{tmp_path / 'bad.yaml'}: {kind}: {error}"


def test_a_bad_document_among_several_is_named(tmp_path: Path):
    (tmp_path / "two.yaml").write_text("kind: Pod\nmetadata: {name: a}\n---\n"
                                       "kind: Pod\nmetadata: {generateName: b-}\n")
    with pytest.raises(WorkloadError, match=r"two\.yaml \(document 2\): Pod: metadata\.name: "):
        load_examples(tmp_path)


def test_kinds_without_pods_need_no_metadata(tmp_path: Path):
    (tmp_path / "a.yaml").write_text("kind: Queue\n---\nkind: Pod\nmetadata: {name: x}\n")
    assert [p.name for p in load_examples(tmp_path)] == ["x"]


# -- the over-the-cap verdict follows the mechanisms the agent reports -------------------------

def _pinned_pod(uuid: str) -> dict:
    """An sm-sharing container as admission wires it: an MPS client with a pinned limit."""
    return {"metadata": {"uid": "u1", "annotations": {}}, "spec": {"containers": [{
        "name": "c", "env": [
            {"name": "CUDA_MPS_PIPE_DIRECTORY", "value": "/run/kai-fractions/mps/x"},
            {"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=100M"},
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": uuid}]}]}}


@pytest.mark.parametrize("mechanisms, held", [
    ({"cgroup", "mps-pinned", "watchdog"}, "cgroup"),
    ({"mps-pinned", "watchdog"}, "mps-pinned"),
    ({"watchdog"}, None),  # the env's pinned limit is wired, but the agent did not apply it
    (set(), None),
])
def test_the_kubelet_stops_an_allocation_only_by_a_tier_in_force(tmp_path: Path, mechanisms,
                                                                   held):
    from kai_fractions.demo.kubelet import CapHeld, SimulatedKubelet
    from kai_fractions.node.cgroups import CgroupLayout
    from kai_fractions.sim.nvml import FakeNvml

    mib = 1024 * 1024
    nvml = FakeNvml.simulated(1)
    nvml.init()
    gpu = nvml.gpus[0].uuid
    nvml.add_process(7, gpu, 90 * mib, cgroup="/sys/fs/cgroup/pod/c")
    nvml.set_memory_limits(gpu, "/sys/fs/cgroup/pod", 0, 100 * mib)
    kubelet = SimulatedKubelet(None, "n", tmp_path, tmp_path, None, nvml, tmp_path,
                               CgroupLayout())
    pod = _pinned_pod(gpu)
    if held is None:
        if "cgroup" not in mechanisms:
            nvml.clear_memory_limits(gpu, "/sys/fs/cgroup/pod")  # none in force, as reported
        kubelet.allocate(pod, "c", gpu, 7, 20 * mib, frozenset(mechanisms))
        assert nvml.processes[0].used_bytes == 110 * mib
        return
    with pytest.raises(CapHeld) as e:
        kubelet.allocate(pod, "c", gpu, 7, 20 * mib, frozenset(mechanisms))
    assert e.value.tier == held
    assert nvml.processes[0].used_bytes == 90 * mib


# -- the session: its directory, its node ---------------------------------------------------------

def test_a_long_tmpdir_puts_the_session_directory_under_tmp(tmp_path: Path, monkeypatch):
    import tempfile

    from kai_fractions.demo import session

    long = tmp_path / ("t" * 40)
    long.mkdir()
    short = tmp_path / "s"
    short.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    monkeypatch.setattr(session, "SHORT_TMP", str(short))
    made = session.make_workdir(DemoConfig())
    assert made.parent == short and made.name.startswith("kf-demo-")
    monkeypatch.setattr(tempfile, "tempdir", "/tmp")
    made = session.make_workdir(DemoConfig())
    assert made.parent == Path("/tmp")
    made.rmdir()


def test_a_session_that_fails_to_build_removes_its_directory(tmp_path: Path, monkeypatch):
    import tempfile

    from kai_fractions.demo import session

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(session, "SHORT_TMP", str(tmp_path))

    def broken(*args, **kwargs):
        raise OSError("no MPS today")

    monkeypatch.setattr(session, "FakeMpsControl", broken)
    with pytest.raises(OSError, match="no MPS today"):
        session.DemoSession(DemoConfig())
    assert list(tmp_path.iterdir()) == []


def test_a_given_directory_too_long_for_its_sockets_is_said(tmp_path: Path):
    from kai_fractions.demo.session import DemoSession

    long = tmp_path / ("d" * 60)
    long.mkdir()
    with pytest.raises(ValueError, match="too long for the unix sockets below it"):
        DemoSession(DemoConfig(), workdir=long)
    assert long.is_dir()  # the caller's: left alone


def test_gpu_summary_counts_by_model():
    from kai_fractions.demo.session import gpu_summary

    nvml = config_from_dict({"gpus": [{"model": "H100-80GB"}, {"model": "T4", "count": 2},
                                      {"model": "H100-80GB"}]}).nvml()
    assert gpu_summary(nvml.gpus) == "2 x NVIDIA H100 80GB HBM3, 2 x Tesla T4"
    assert gpu_summary(DemoConfig().nvml().gpus) == "2 x NVIDIA H100 80GB HBM3"

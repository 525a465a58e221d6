"""Pod views from manifests: Pods, every workload kind with a pod template, and the templates
other kinds nest below their spec."""

from __future__ import annotations

import copy
from types import MappingProxyType

import pytest

from kai_fractions.contract import PodView, parse_pod, pod, pod_specs, pod_views, view_from_pod_spec
from kai_fractions.contract.pod import ContainerView, ManifestError

ANNOTATIONS = {"gpu-fraction": "0.5"}
POD_SPEC = {
    "initContainers": [{"name": "setup", "image": "busybox"}],
    "containers": [
        {"name": "main", "image": "cuda", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
        {"name": "side", "image": "busybox"},
    ],
}
TEMPLATE = {"metadata": {"annotations": ANNOTATIONS, "labels": {"app": "x"}}, "spec": POD_SPEC}


def workload(kind: str) -> dict:
    meta = {"name": "w", "namespace": "team"}
    template = copy.deepcopy(TEMPLATE)
    if kind == "Pod":
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {**meta, **template["metadata"]},
                "spec": template["spec"]}
    if kind == "CronJob":
        return {"apiVersion": "batch/v1", "kind": kind, "metadata": meta,
                "spec": {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": template}}}}
    if kind == "PodTemplate":
        return {"apiVersion": "v1", "kind": kind, "metadata": meta, "template": template}
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": meta,
            "spec": {"selector": {}, "template": template}}


@pytest.mark.parametrize(
    ("kind", "ref"),
    [
        ("Pod", "team/w"),
        ("Deployment", "Deployment/team/w"),
        ("StatefulSet", "StatefulSet/team/w"),
        ("DaemonSet", "DaemonSet/team/w"),
        ("ReplicaSet", "ReplicaSet/team/w"),
        ("Job", "Job/team/w"),
        ("CronJob", "CronJob/team/w"),
        ("PodTemplate", "PodTemplate/team/w"),
    ],
)
def test_every_kind_with_a_pod_template(kind: str, ref: str) -> None:
    (view,) = list(pod_views(workload(kind)))
    assert isinstance(view, PodView)
    assert view.kind == kind
    assert view.name == "w"
    assert view.namespace == "team"
    assert view.ref == ref
    assert dict(view.annotations) == ANNOTATIONS
    assert dict(view.labels) == {"app": "x"}
    assert [c.name for c in view.containers] == ["main", "side"]
    assert [c.name for c in view.init_containers] == ["setup"]
    assert all(c.init for c in view.init_containers)
    assert not any(c.init for c in view.containers)
    assert [c.name for c in view.all_containers] == ["main", "side", "setup"]
    assert view.containers[0].whole_gpus == 1
    assert view.containers[1].whole_gpus == 0


def test_list_yields_each_item() -> None:
    obj = {"apiVersion": "v1", "kind": "List",
           "items": [workload("Pod"), workload("Deployment"), {"kind": "ConfigMap"}]}
    assert [v.ref for v in pod_views(obj)] == ["team/w", "Deployment/team/w"]


@pytest.mark.parametrize(
    "obj",
    [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}, "spec": {}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "n"}},
        {"apiVersion": "v1", "kind": "List", "items": []},
        {},
    ],
)
def test_kinds_without_pods_yield_nothing(obj: dict) -> None:
    assert list(pod_views(obj)) == []


def test_non_mapping_yields_nothing() -> None:
    assert list(pod_views([1, 2])) == []  # type: ignore[arg-type]


def test_pod_defaults() -> None:
    (view,) = pod_views({"kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": []}})
    assert view.namespace == "default"
    assert view.uid == ""
    assert view.ref == "default/p"


def test_annotation_values_must_be_strings_as_the_api_server_says() -> None:
    """YAML reads an unquoted `010240` as the octal number 4256: converted, `validate` passed a
    manifest `kubectl apply` refuses and `plan` printed 4256 MiB. Null reads as "" (as the API
    server's decoder reads it)."""
    (view,) = pod_views({"kind": "Pod", "metadata": {"name": "p", "annotations": {
        "gpu-memory": "1000", "gpu-fraction": None}}, "spec": {}})
    assert dict(view.annotations) == {"gpu-memory": "1000", "gpu-fraction": ""}
    for value in (4256, 0.5, True):
        with pytest.raises(ManifestError) as e:
            list(pod_views({"kind": "Pod", "metadata": {"name": "p", "annotations": {
                "gpu-memory": value}}, "spec": {}}))
        assert str(e.value) == (f"metadata.annotations['gpu-memory']: must be a string, got "
                                f"{value!r} ({type(value).__name__}); quote the value in YAML")


def test_view_from_pod_spec_reads_uid_and_node() -> None:
    view = view_from_pod_spec({"name": "p", "namespace": "ns", "uid": "u-1"},
                              {"nodeName": "n1", "containers": [{"name": "c"}]})
    assert (view.uid, view.node_name, view.ref) == ("u-1", "n1", "ns/p")


def test_whole_gpu_from_requests_when_no_limits() -> None:
    view = view_from_pod_spec({"name": "p"}, {"containers": [
        {"name": "c", "resources": {"requests": {"nvidia.com/gpu": 2}}}]})
    assert view.containers[0].whole_gpus == 2


def test_views_are_immutable() -> None:
    (view,) = pod_views(workload("Pod"))
    with pytest.raises(AttributeError):
        view.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        view.annotations["x"] = "y"  # type: ignore[index]


def test_init_container_keys_are_valid_on_workloads() -> None:
    obj = workload("Deployment")
    obj["spec"]["template"]["metadata"]["annotations"] = {
        "nvidia.com/container.setup.gpu-memory.request": "1Gi"}
    # No whole GPU beside the fraction: KAI refuses that pod whichever container asks for it.
    del obj["spec"]["template"]["spec"]["containers"][0]["resources"]
    (view,) = pod_views(obj)
    request = parse_pod(view)
    assert request.errors == ()
    assert request.share is not None and request.share.container == "setup"


def test_with_annotations_changes_the_annotations_and_nothing_else() -> None:
    import dataclasses

    view = view_from_pod_spec(
        {"name": "p", "namespace": "ns", "uid": "u", "labels": {"a": "b"},
         "annotations": {"x": "1"}},
        {"nodeName": "n1", "containers": [{"name": "c"}], "initContainers": [{"name": "i"}]},
        kind="Job")
    other = view.with_annotations({"y": "2"})
    assert other == dataclasses.replace(view, annotations={"y": "2"})
    # every field is passed on: a field added to PodView later must be added there too (but
    # `_by_name`, an index of the containers built on first use, not a constructor argument)
    assert {f.name for f in dataclasses.fields(PodView) if f.init} == {
        "name", "namespace", "uid", "annotations", "labels", "containers", "init_containers",
        "node_name", "kind"}


def test_a_read_only_string_map_is_shared_by_the_view_and_any_other_map_is_copied():
    shared = MappingProxyType({"team": "a"})
    given = {"team": "a"}
    view = view_from_pod_spec({"name": "p", "annotations": shared, "labels": given}, {})
    assert view.annotations is shared  # nobody can change it through the view
    given["team"] = "b"
    assert view.labels == {"team": "a"}  # a copy: the caller's later change is not the view's


@pytest.mark.parametrize("count", [3, 40])
def test_a_container_is_found_by_name_the_first_of_a_name_winning(count: int) -> None:
    """Past a few containers the lookup uses an index (admission parses pods that bring
    thousands, before the API server's limits apply); it finds what the loop finds: the
    first container of a name, a regular one before an init one."""
    containers = tuple(ContainerView(f"c{i}") for i in range(count))
    first, second = ContainerView("dup", whole_gpus=1), ContainerView("dup", whole_gpus=2)
    init = (ContainerView("dup", whole_gpus=3, init=True), ContainerView("only-init", init=True))
    view = PodView("p", containers=(*containers, first, second), init_containers=init)
    assert view.container("dup") is first
    assert view.container("only-init") is init[1]
    assert view.container(f"c{count - 1}") is containers[-1]
    assert view.container("absent") is None
    assert view == PodView("p", containers=(*containers, first, second), init_containers=init)


# -- pod templates other kinds nest below their spec ------------------------------------------


def nested(kind: str, spec: dict) -> dict:
    return {"apiVersion": "x/v1", "kind": kind, "metadata": {"name": "w", "namespace": "team"},
            "spec": spec}


def tmpl(fraction: str) -> dict:
    return {"metadata": {"annotations": {"gpu-fraction": fraction}},
            "spec": {"containers": [{"name": "main", "image": "cuda"}]}}


@pytest.mark.parametrize(
    ("obj", "paths"),
    [
        (nested("PyTorchJob", {"pytorchReplicaSpecs": {
            "Master": {"replicas": 1, "template": tmpl("0.1")},
            "Worker": {"replicas": 4, "template": tmpl("0.2")}}}),
         ["spec.pytorchReplicaSpecs.Master.template", "spec.pytorchReplicaSpecs.Worker.template"]),
        (nested("MPIJob", {"mpiReplicaSpecs": {"Launcher": {"template": tmpl("0.1")}}}),
         ["spec.mpiReplicaSpecs.Launcher.template"]),
        (nested("LeaderWorkerSet", {"leaderWorkerTemplate": {
            "leaderTemplate": tmpl("0.1"), "workerTemplate": tmpl("0.2"), "size": 4}}),
         ["spec.leaderWorkerTemplate.leaderTemplate", "spec.leaderWorkerTemplate.workerTemplate"]),
        (nested("RayCluster", {"headGroupSpec": {"template": tmpl("0.1")}, "workerGroupSpecs": [
            {"groupName": "a", "template": tmpl("0.2")},
            {"groupName": "b", "template": tmpl("0.3")}]}),
         ["spec.headGroupSpec.template", "spec.workerGroupSpecs[0].template",
          "spec.workerGroupSpecs[1].template"]),
        (nested("RayJob", {"rayClusterSpec": {"headGroupSpec": {"template": tmpl("0.1")}},
                           "submitterPodTemplate": tmpl("0.2")}),
         ["spec.rayClusterSpec.headGroupSpec.template", "spec.submitterPodTemplate"]),
        (nested("JobSet", {"replicatedJobs": [
            {"name": "r", "template": {"spec": {"template": tmpl("0.1")}}}]}),
         ["spec.replicatedJobs[0].template.spec.template"]),
        (nested("Service", {"template": tmpl("0.1")}),  # Knative serving.knative.dev/v1
         ["spec.template"]),
    ],
    ids=["pytorchjob", "mpijob", "leaderworkerset", "raycluster", "rayjob", "jobset", "knative"],
)
def test_templates_nested_below_any_kinds_spec_are_found_with_their_path(obj, paths) -> None:
    """KAI's pod-grouper schedules these kinds' pods: with only `spec.template` read, their
    fraction annotations went unchecked."""
    found = list(pod_specs(obj))
    assert [f.template for f in found] == paths
    assert [f.path for f in found] == [p + ".spec" for p in paths]
    assert [f.view.ref for f in found] == [f"{obj['kind']}/team/w"] * len(paths)
    assert [f.view.annotations["gpu-fraction"] for f in found] == [
        f"0.{i}" for i in range(1, len(paths) + 1)]
    assert all([c.name for c in f.view.containers] == ["main"] for f in found)


def test_the_known_kinds_keep_their_one_template_unnamed() -> None:
    for kind in ("Deployment", "CronJob", "PodTemplate"):
        (found,) = pod_specs(workload(kind))
        assert found.template == "", kind


def test_a_nested_template_of_the_wrong_shape_is_named_by_its_path() -> None:
    template = tmpl("0.5")
    template["metadata"]["annotations"]["gpu-fraction"] = 0.5  # unquoted in YAML
    with pytest.raises(ManifestError) as e:
        list(pod_specs(nested("PyTorchJob", {"pytorchReplicaSpecs": {
            "Worker": {"template": template}}})))
    assert str(e.value).startswith("spec.pytorchReplicaSpecs.Worker.template.metadata."
                                   "annotations['gpu-fraction']: must be a string")


def test_the_search_stops_below_its_depth() -> None:
    def at_depth(depth: int) -> dict:
        spec: dict = tmpl("0.5")
        for _ in range(depth):
            spec = {"x": spec}
        return nested("Deep", spec)

    assert [f.template for f in pod_specs(at_depth(pod.MAX_TEMPLATE_DEPTH))] == [
        "spec" + ".x" * pod.MAX_TEMPLATE_DEPTH]
    assert list(pod_specs(at_depth(pod.MAX_TEMPLATE_DEPTH + 1))) == []


def test_yaml_aliases_are_searched_once_so_they_cannot_multiply_the_work(monkeypatch) -> None:
    """A billion-laughs document: 30 levels of ten aliases of the level below are 10**30 paths
    but 31 values; each is read once, so 100 values are plenty."""
    monkeypatch.setattr(pod, "MAX_SEARCHED_VALUES", 100)
    level: list = [{"spec": {"volumes": []}}]
    for _ in range(30):
        level = [level] * 10
    assert list(pod_specs(nested("Laughs", {"a": level}))) == []


def test_a_document_with_more_values_than_the_search_reads_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(pod, "MAX_SEARCHED_VALUES", 100)
    with pytest.raises(ManifestError) as e:
        list(pod_specs(nested("Big", {"items": [{"n": i} for i in range(200)]})))
    assert str(e.value) == ("spec: more than 100 mappings and lists to search for pod "
                            "templates, more than an object Kubernetes stores; split it")

"""Rendering the chart with the real `helm` (from .tools/, via tests.support.tools) and reading
the result. Each distinct render runs helm once per test session (helm costs ~0.1-1 s a call)."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.support import tools

REPO = tools.REPO_ROOT
CHART = REPO / "charts" / "kai-fractions"
CI_VALUES = tuple(sorted((CHART / "ci").glob("*.yaml")))
EXAMPLES = REPO / "examples"
NAMESPACE = "kai-fractions"
RELEASE = "kf"
# image.repository is required (the project publishes no image, and the chart refuses to render
# without one): every render sets it first, so a test's own --set (later) wins.
TEST_IMAGE = "registry.example.com/kai-fractions"
IMAGE_SETS = (f"image.repository={TEST_IMAGE}",)
# The chart's floor (Chart.yaml kubeVersion) and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.30.0", "1.35.0")
# Kinds the official OpenAPI schemas do not have (CRDs): kubernetes-validate only warns on them.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("scheduling.run.ai/v2", "Queue"),
                ("monitoring.coreos.com/v1", "PrometheusRule"),
                ("gpu-fractioning.kai.scheduler/v1alpha1", "GpuFractioningConfig")}


class HelmError(AssertionError):
    """helm exited non-zero: the message carries its stderr."""


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tools.helm()), *args], capture_output=True, text=True,
                          timeout=60, check=False)


def _template_args(values_file: Path | None, sets: tuple[str, ...],
                   image: bool = True, namespace: str = NAMESPACE) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", namespace]
    if values_file is not None:
        args += ["--values", str(values_file)]
    for s in (*IMAGE_SETS, *sets) if image else sets:
        args += ["--set", s]
    return args


@functools.cache
def render_text(values_file: Path | None = None, sets: tuple[str, ...] = (),
                image: bool = True, namespace: str = NAMESPACE) -> str:
    """`image=False`: without the test image, as a user who set no image.repository.
    `namespace`: the release namespace (`helm template --namespace`)."""
    proc = helm(*_template_args(values_file, sets, image, namespace))
    if proc.returncode != 0:
        raise HelmError(f"helm template failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def render(values_file: Path | None = None, sets: tuple[str, ...] = (),
           image: bool = True, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render_text(values_file, sets, image, namespace)) if d]


def chart_notes(*sets: str, values_file: Path | None = None) -> str:
    """NOTES.txt as `helm install --dry-run=client` prints it, with `--set` values."""
    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"]
    if values_file is not None:
        args += ["--values", str(values_file)]
    for value in (*IMAGE_SETS, *sets):
        args += ["--set", value]
    proc = helm(*args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("NOTES:", 1)[1]


def template_error(*sets: str, set_string: Iterable[str] = (), image: bool = True,
                   namespace: str = NAMESPACE, values_file: Path | None = None) -> str:
    """helm template that must FAIL: returns its stderr."""
    args = _template_args(values_file, tuple(sets), image, namespace)
    for s in set_string:
        args += ["--set-string", s]
    proc = helm(*args)
    assert proc.returncode != 0, f"helm template succeeded with {sets} {list(set_string)}"
    return proc.stderr


def install_in_cluster(kubeconfig: Path, *sets: str, cache: Path,
                       values_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`helm install --dry-run=server` against the API server of `kubeconfig` (a test's kmock,
    made to look enough like a cluster by tests.chart.live_cluster): `lookup` asks that
    cluster, as in a real install or upgrade, and the output has the NOTES. Nothing is
    created. No OpenAPI validation (kmock serves none), and gpuFractioningConfig.enabled=false
    (kmock knows no GpuFractioningConfig kind) unless `sets` say otherwise. `cache`: client-go's
    discovery cache (KUBECACHEDIR), kept out of ~/.kube."""
    import os

    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kubeconfig",
            str(kubeconfig), "--dry-run=server", "--disable-openapi-validation"]
    if values_file is not None:
        args += ["--values", str(values_file)]
    for value in (*IMAGE_SETS, "gpuFractioningConfig.enabled=false", *sets):
        args += ["--set", value]
    return subprocess.run([str(tools.helm()), *args], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "KUBECACHEDIR": str(cache)})


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind
            and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    for c in workload["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    ref = f"{workload['kind']}/{workload['metadata']['name']}"
    raise AssertionError(f"{ref} has no container {name}")


def yaml_files(folder: Path) -> Iterator[Path]:
    yield from sorted(p for p in folder.rglob("*") if p.suffix in (".yaml", ".yml"))


def values_id(path: Path | None) -> str:
    return "default" if path is None else path.name


def kube_validate(docs: Iterable[dict[str, Any]], where: str) -> list[str]:
    """Problems `kubernetes-validate --strict` finds, for every version in KUBE_VERSIONS. A kind
    without an official schema is a problem unless it is one of CUSTOM_KINDS."""
    import kubernetes_validate
    from kubernetes_validate import utils
    from kubernetes_validate.utils import SchemaNotFoundError

    # kubernetes-validate re-reads and re-parses its schema files (megabytes) on every call;
    # the files never change, so read each once per session.
    if not hasattr(utils.schema_contents, "cache_info"):
        utils.schema_contents = functools.cache(utils.schema_contents)
    problems = []
    for doc in docs:
        ref = f"{where}: {doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except SchemaNotFoundError:
                if (doc.get("apiVersion"), doc.get("kind")) not in CUSTOM_KINDS:
                    problems.append(f"{ref}: no schema for {doc.get('apiVersion')} in {version}")
                break
            except kubernetes_validate.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                problems.append(f"{ref} (k8s {version}) at {path}: {e.message}")
    return problems

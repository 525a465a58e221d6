"""The simulatedLookup values (signing., mirror., gpuFractioningConfig., webhook.tls.,
uninstallHook.) stand in for `lookup` where the render has no cluster. Left set in a real
install they hid the cluster from every upgrade (a new webhook CA or signing key each time, the
old CA no longer kept): the render fails where `lookup` of the release namespace finds it, a live
cluster.

`helm template` (the other tests) has no cluster, and keeps rendering them. The live cluster
here is kmock behind `helm install --dry-run=server` (tests.chart.live_cluster), whose `lookup`
calls reach it: the chart's own `lookup` of the Namespace is what is tested, not a switch of
the test's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.kube import KubeServer

from .live_cluster import live_cluster, namespace_path
from .render import install_in_cluster, render, template_error

# One --set per simulatedLookup value, each a lookup result that renders fine on its own.
SIMULATED = {
    "signing.simulatedLookup": "signing.simulatedLookup.legacy.current=QUJD",
    "mirror.simulatedLookup": "mirror.simulatedLookup.writeAsBinderRoleBinding.metadata.name="
                              "kai-fractions-mirror-write-as-binder",
    "gpuFractioningConfig.simulatedLookup": "gpuFractioningConfig.simulatedLookup.crd.metadata."
                                            "labels.app\\.kubernetes\\.io/part-of=kai-fractions",
    "webhook.tls.simulatedLookup": "webhook.tls.simulatedLookup.mutating.metadata.name="
                                   "kai-fractions-admission",
    "uninstallHook.simulatedLookup": "uninstallHook.simulatedLookup.nodeAgentDaemonSet.metadata."
                                     "name=kai-fractions-node-agent",
}
REFUSED = ("set, and this render reaches a cluster (namespace kai-fractions exists): these values "
           "are for tests and renders without a cluster only (helm template, --dry-run=client)")


def _install(kube: KubeServer, tmp_path: Path, *sets: str,
             namespace: bool = True) -> subprocess.CompletedProcess[str]:
    config = live_cluster(kube, tmp_path, namespace=namespace)
    return install_in_cluster(config, *sets, cache=tmp_path / "kube-cache")


@pytest.mark.parametrize("value", list(SIMULATED))
def test_a_simulated_lookup_in_a_live_cluster_fails_the_render(
        value: str, kube: KubeServer, tmp_path: Path) -> None:
    proc = _install(kube, tmp_path, SIMULATED[value])
    assert proc.returncode != 0
    assert f"{value} is {REFUSED}" in proc.stderr
    assert "generate a new webhook CA or signing key on every upgrade" in proc.stderr
    assert f"--set {value}=null" in proc.stderr
    # without a cluster (helm template) it stands in for lookup, as before
    render(sets=(SIMULATED[value],))


def test_every_simulated_lookup_set_is_named(kube: KubeServer, tmp_path: Path) -> None:
    proc = _install(kube, tmp_path, *SIMULATED.values())
    assert (f"signing.simulatedLookup, mirror.simulatedLookup, "
            f"gpuFractioningConfig.simulatedLookup, webhook.tls.simulatedLookup, "
            f"uninstallHook.simulatedLookup are {REFUSED}"
            ) in proc.stderr
    assert ("--set signing.simulatedLookup=null,mirror.simulatedLookup=null,"
            "gpuFractioningConfig.simulatedLookup=null,webhook.tls.simulatedLookup=null,"
            "uninstallHook.simulatedLookup=null"
            ) in proc.stderr


def test_without_simulated_lookups_the_install_goes_through_and_asks_no_more(
        kube: KubeServer, tmp_path: Path) -> None:
    """An ordinary install asks nothing more of the cluster (nor of the Helm user's RBAC): the
    Namespace is not even looked up, while the chart's own lookups reached the cluster."""
    proc = _install(kube, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "NOTES:" in proc.stdout
    assert kube.count("GET", namespace_path()) == 0
    assert kube.count("GET", f"{namespace_path()}/secrets/kai-fractions-admission-tls") >= 1


def test_a_cluster_without_the_release_namespace_keeps_the_simulated_values(
        kube: KubeServer, tmp_path: Path) -> None:
    """The check is the release namespace's lookup: where it finds none, nothing of this
    release can be in the cluster to hide, and the render is not refused."""
    proc = _install(kube, tmp_path, *SIMULATED.values(), namespace=False)
    assert "simulatedLookup" not in proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert kube.count("GET", namespace_path()) >= 1  # asked, and not found


def test_the_schema_keeps_the_mirrors_simulated_lookup_to_its_shape():
    error = template_error("mirror.simulatedLookup.roleBinding.metadata.name=x")
    assert "additional properties 'roleBinding' not allowed" in error

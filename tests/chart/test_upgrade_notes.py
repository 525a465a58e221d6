"""What an upgrade from a release before mirror.writeAsBinder defaulted to false meets, said in
NOTES.txt: a user of the gRPC path upgrading with the same values file (which never set it)
loses the mirror's impersonation of KAI's binder. The RoleBinding the older release rendered,
found in KAI's namespace, says so; so does kaiScheduler.dialect=patched, whose binder calls the
mirror's gRPC MirrorAllocation.

`lookup` asks the cluster: kmock behind `helm install --dry-run=server` (tests.chart.live_cluster),
and mirror.simulatedLookup where `helm install --dry-run=client` has none."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.kube import KubeServer

from .live_cluster import holds, live_cluster
from .render import CHART, NAMESPACE, RELEASE, chart_notes, install_in_cluster

BINDING = "kai-fractions-mirror-write-as-binder"
SIMULATED = f"mirror.simulatedLookup.writeAsBinderRoleBinding.metadata.name={BINDING}"
BANNER = "WARNING: mirror.writeAsBinder NOW DEFAULTS TO false (it was true)"
PATCHED = ("WARNING: kaiScheduler.dialect=patched with mirror.writeAsBinder=false: "
           "mirror.writeAsBinder now\ndefaults to false (it was true).")


def _binding_path(namespace: str) -> str:
    return f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings/{BINDING}"


def _notes(kube: KubeServer, tmp_path: Path, *sets: str, binding_in: str | None) -> str:
    config = live_cluster(kube, tmp_path)
    if binding_in is not None:
        holds(kube, _binding_path(binding_in), {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {
                "name": BINDING, "namespace": binding_in,
                # as the older release left it: Helm's (an install that renders it takes it)
                "labels": {"app.kubernetes.io/managed-by": "Helm"},
                "annotations": {"meta.helm.sh/release-name": RELEASE,
                                "meta.helm.sh/release-namespace": NAMESPACE}}})
    proc = install_in_cluster(config, *sets, cache=tmp_path / "kube-cache")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("NOTES:", 1)[1]


def test_an_upgrade_that_drops_the_binders_rolebinding_warns_and_names_the_value(
        kube: KubeServer, tmp_path: Path) -> None:
    """The values file of a gRPC-path user never set mirror.writeAsBinder (it defaulted to
    true): the RoleBinding the older release rendered is in KAI's namespace, this render
    removes it, and NOTES.txt says what changed and what to set."""
    notes = _notes(kube, tmp_path, binding_in="kai-scheduler")
    assert BANNER in notes
    assert (f"RoleBinding {BINDING}\nin namespace kai-scheduler, which the earlier release "
            "rendered, is in the cluster") in notes
    assert "KAI's NvFractions webhook now refuses its writes of .gpus.devices" in notes
    assert "  mirror.writeAsBinder: true\n" in notes
    assert "--set mirror.writeAsBinder=true" in notes
    # the chart's own lookup asked KAI's namespace for it, once
    assert kube.count("GET", _binding_path("kai-scheduler")) == 1


def test_the_rolebinding_is_looked_up_in_kais_namespace(kube: KubeServer,
                                                        tmp_path: Path) -> None:
    notes = _notes(kube, tmp_path, "kaiScheduler.namespace=kai-system", binding_in="kai-system")
    assert "in namespace kai-system, which the earlier release rendered" in notes


@pytest.mark.parametrize("case", ["no binding", "binding elsewhere", "writeAsBinder=true"])
def test_no_warning_without_the_binding_or_with_write_as_binder(
        kube: KubeServer, tmp_path: Path, case: str) -> None:
    sets, where = {"no binding": ((), None), "binding elsewhere": ((), "kai-system"),
                   "writeAsBinder=true": (("mirror.writeAsBinder=true",), "kai-scheduler")}[case]
    notes = _notes(kube, tmp_path, *sets, binding_in=where)
    assert "NOW DEFAULTS TO false" not in notes


def test_the_simulated_lookup_stands_in_without_a_cluster() -> None:
    assert BANNER in chart_notes(SIMULATED)
    assert "RoleBinding kai-fractions-mirror-write-as-binder\nin namespace kai-system" in \
        chart_notes(SIMULATED, "kaiScheduler.namespace=kai-system")
    assert "NOW DEFAULTS TO false" not in chart_notes()
    assert "NOW DEFAULTS TO false" not in chart_notes(SIMULATED, "mirror.writeAsBinder=true")
    # a binding the cluster does not hold ({}): nothing to warn of
    assert "NOW DEFAULTS TO false" not in chart_notes(
        "mirror.simulatedLookup.writeAsBinderRoleBinding=null")


def test_the_patched_dialect_without_write_as_binder_is_a_warning_naming_the_new_default():
    """A patched KAI's binder calls MirrorAllocation: with mirror.writeAsBinder left at its new
    default its writes are refused. Not a hint among others: a WARNING."""
    notes = chart_notes("kaiScheduler.dialect=patched", "mirror.reserveMiB=1024")
    assert PATCHED in notes
    assert ("unless they are made as system:serviceaccount:kai-scheduler:binder:\n"
            "set mirror.writeAsBinder=true.") in notes
    # the scenario's values file sets it: no warning
    patched = chart_notes(values_file=CHART / "ci" / "patched-kai-values.yaml")
    assert "KAI dialect: patched" in patched
    assert "WARNING: kaiScheduler.dialect" not in patched
    # the upstream dialect keeps its conditional hint, no warning
    assert "WARNING: kaiScheduler.dialect" not in chart_notes()

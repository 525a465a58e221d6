"""The uninstall hook (uninstallHook.enabled): before, `helm uninstall` deleted the node agent
DaemonSet, its RBAC and the mirror in one pass with no hook, so no agent could still publish its
condition False and every GPU node stayed ready for KAI with nothing enforcing limits there (an
upgrade to gpuSharing: Disabled, which renders nothing, did the same). Now a pre-delete hook
(pre-upgrade on that upgrade) runs `kai-fractions retire-nodes` with exactly the rights it needs,
RBAC first, and a policy lets its service account set our conditions Unknown and nothing else."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from kai_fractions.contract import keys as k
from kai_fractions.kube.objects import condition_time

from .node_metadata_edits import METADATA_EDITS
from .render import (
    CHART,
    IMAGE_SETS,
    NAMESPACE,
    RELEASE,
    container,
    find,
    helm,
    one,
    render,
    template_error,
)
from .test_node_agent_policy import AGENT_USER, changed, condition, node, review

NAME = "kai-fractions-retire-nodes"
HOOK_USER = f"system:serviceaccount:{NAMESPACE}:{NAME}"
AGENT = "kai-fractions-node-agent"
KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Job")
DISABLED = CHART / "ci" / "disabled-values.yaml"


def hook_objects(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs if d["metadata"]["name"] == NAME
            and d["kind"] in KINDS}


# What `lookup` finds of a release whose node agents run (an upgrade to Disabled runs the hook
# only then): helm template has no cluster.
AGENTS_RUN = f"uninstallHook.simulatedLookup.nodeAgentDaemonSet.metadata.name={AGENT}"
# c17c866's values.yaml: the last release's, made before uninstallHook existed.
RELEASED_VALUES = Path(__file__).parent / "data" / "c17c866-values.yaml"


def upgrade_render(*sets: str) -> list[dict]:
    """`helm template --is-upgrade` with the Disabled values: the render of `helm upgrade` to
    gpuSharing: Disabled, of a release whose node agents run."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--is-upgrade",
            "--values", str(DISABLED)]
    for s in (*IMAGE_SETS, AGENTS_RUN, *sets):
        args += ["--set", s]
    proc = helm(*args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def hook() -> dict[str, dict]:
    return hook_objects(render())


def test_a_pre_delete_hook_rbac_first(hook):
    assert sorted(hook) == sorted(KINDS)
    for kind, obj in hook.items():
        notes = obj["metadata"]["annotations"]
        assert notes["helm.sh/hook"] == "pre-delete", kind
        assert notes["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        assert notes["helm.sh/hook-weight"] == ("0" if kind == "Job" else "-10"), kind


def test_its_rbac_is_exactly_what_retire_nodes_calls(hook):
    assert hook["ClusterRole"]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterrolebindings"],
         "resourceNames": [AGENT], "verbs": ["delete"]}]
    assert hook["Role"]["metadata"]["namespace"] == NAMESPACE
    assert hook["Role"]["rules"] == [
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": [AGENT],
         "verbs": ["get", "delete"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    subject = [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}]
    for kind, role in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        assert hook[kind]["subjects"] == subject
        assert hook[kind]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                         "kind": role, "name": NAME}


def test_the_job_runs_retire_nodes_restricted_and_bounded(hook):
    docs = render()
    job = hook["Job"]
    spec = job["spec"]["template"]["spec"]
    assert job["spec"]["backoffLimit"] == 1
    assert job["spec"]["activeDeadlineSeconds"] == 240  # the wait (120 s) and some room
    assert (spec["serviceAccountName"], spec["restartPolicy"]) == (NAME, "Never")
    mirror_spec = one(docs, "Deployment", "kai-fractions-mirror")["spec"]["template"]["spec"]
    assert spec["securityContext"] == mirror_spec["securityContext"]
    c = container(job, "retire-nodes")
    assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["image"] == container(one(docs, "Deployment", "kai-fractions-mirror"),
                                   "mirror")["image"]
    assert c["args"] == [
        "retire-nodes", f"--node-agent-daemonset={NAMESPACE}/{AGENT}",
        "--node-agent-selector=app.kubernetes.io/component=node-agent,"
        f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/name=kai-fractions",
        f"--node-agent-binding={AGENT}",
        f"--node-condition={k.NODE_CONDITION}", f"--node-condition={k.LEGACY_NODE_CONDITION}",
        "--wait-seconds=120", "--deadline-seconds=210"]
    selector = one(docs, "DaemonSet", AGENT)["spec"]["selector"]["matchLabels"]
    assert c["args"][2] == "--node-agent-selector=" + ",".join(
        f"{key}={value}" for key, value in sorted(selector.items()))


def test_agents_left_running_lose_their_binding_and_only_that_one(hook):
    """Before, an agent that outlived the hook's wait (its kubelet down) wrote its condition
    True again after the hook set it Unknown. Now the hook may delete the node agent's
    ClusterRoleBinding, its one grant of nodes/status (and nodes), by name and nothing else, and
    is told its name."""
    docs = render()
    granting = [b["metadata"]["name"] for b in docs
                if b["kind"] in ("ClusterRoleBinding", "RoleBinding")
                and any(s["name"] == AGENT for s in b["subjects"])
                and any("nodes/status" in r["resources"] for r in one(
                    docs, b["roleRef"]["kind"], b["roleRef"]["name"])["rules"])]
    assert granting == [AGENT]
    assert one(docs, "ClusterRoleBinding", AGENT)["roleRef"]["name"] == AGENT
    assert [r for r in hook["ClusterRole"]["rules"] if "delete" in r["verbs"]] == [
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterrolebindings"],
         "resourceNames": [AGENT], "verbs": ["delete"]}]
    assert f"--node-agent-binding={AGENT}" in container(hook["Job"], "retire-nodes")["args"]
    job = hook_objects(upgrade_render())["Job"]  # and on the upgrade to Disabled
    assert f"--node-agent-binding={AGENT}" in container(job, "retire-nodes")["args"]


ARGO = {"argocd.argoproj.io/hook": "PreDelete",
        "argocd.argoproj.io/hook-delete-policy": "BeforeHookCreation,HookSucceeded"}


def test_argo_cd_runs_it_before_deleting_the_application(hook):
    """Before, Argo CD (which renders with `helm template` and maps only Helm's install and
    upgrade hooks) never ran a pre-delete hook: deleting the Application left every GPU node
    ready for KAI with no agent. Now the pre-delete render carries Argo CD's own PreDelete
    annotations (Helm ignores them); the pre-upgrade render, which Argo CD never sees as such,
    carries none."""
    for kind, obj in hook.items():
        notes = obj["metadata"]["annotations"]
        assert {key: notes.get(key) for key in ARGO} == ARGO, kind
    for kind, obj in hook_objects(upgrade_render()).items():
        assert not set(ARGO) & set(obj["metadata"]["annotations"]), kind
    # the release's objects are no Argo CD hooks: the node-status policy is in force first
    for doc in render():
        if doc["metadata"]["name"] != NAME:
            assert not set(ARGO) & set(doc["metadata"].get("annotations") or {}), doc["kind"]


def test_a_run_that_says_what_is_left_fails_the_job_at_once_with_its_log(hook):
    """Before, `backoffLimit: 1` ran again a run that had exited 1 (pods left: the same answer
    each time), and `activeDeadlineSeconds` killed that second run: the operator saw
    DeadlineExceeded and a cut log. Now exit codes 1 and 2 fail the Job at once, a pod lost with
    its node (DisruptionTarget, whatever its exit code) still gets its one retry, and Helm 4
    prints a failed hook's log."""
    job = hook["Job"]
    assert job["spec"]["backoffLimit"] == 1
    assert job["spec"]["podFailurePolicy"] == {"rules": [
        {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget",
                                                 "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": "retire-nodes",
                                              "operator": "In", "values": [1, 2]}}]}
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy's
    assert job["metadata"]["annotations"]["helm.sh/hook-output-log-policy"] == "hook-failed"
    upgrade_job = hook_objects(upgrade_render())["Job"]
    assert upgrade_job["spec"]["podFailurePolicy"] == job["spec"]["podFailurePolicy"]
    for kind, obj in hook.items():
        if kind != "Job":
            assert "helm.sh/hook-output-log-policy" not in obj["metadata"]["annotations"]


def test_turned_off_nothing_is_rendered():
    docs = render(None, ("uninstallHook.enabled=false",))
    assert hook_objects(docs) == {}
    assert not find(docs, "ValidatingAdmissionPolicy", f"{NAME}-node-status")
    assert hook_objects(upgrade_render("uninstallHook.enabled=false")) == {}


def test_an_upgrade_to_disabled_runs_it_before_and_an_install_renders_nothing():
    docs = upgrade_render()
    hook = hook_objects(docs)
    assert sorted(hook) == sorted(KINDS)
    assert {o["metadata"]["annotations"]["helm.sh/hook"] for o in hook.values()} == {
        "pre-upgrade"}
    assert len(docs) == len(KINDS)  # nothing else: Disabled still renders no release object
    assert render(DISABLED) == []
    assert render(DISABLED, image=False) == []  # an install: nothing needs the image
    # An upgrade without the release's values (no image): refused, saying what to do.
    proc = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--is-upgrade",
                "--values", str(DISABLED), "--set", AGENTS_RUN)
    assert proc.returncode != 0 and "uninstallHook.enabled" in proc.stderr
    # --reuse-values would keep the old chart's defaults too (a new value missing)
    assert "--reset-then-reuse-values --set gpuSharing=Disabled" in proc.stderr


def test_an_upgrade_of_a_release_already_disabled_runs_no_hook():
    """Before, every upgrade of a release already `gpuSharing: Disabled` (no node agent left)
    rendered the pre-upgrade hook: it failed without image.repository, and its account, which
    may patch any node's status, ran without the narrowing policy a Disabled render lacks. Now
    the hook renders only where `lookup` finds the node agent DaemonSet: none found (here `helm
    template`, no cluster), nothing at all is rendered, and no image is asked for."""
    for sets in ((), IMAGE_SETS):
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--is-upgrade",
                "--values", str(DISABLED)]
        for value in sets:
            args += ["--set", value]
        proc = helm(*args)
        assert proc.returncode == 0, proc.stderr
        assert [d for d in yaml.safe_load_all(proc.stdout) if d] == [], sets


def test_an_upgrade_reusing_the_last_releases_values_renders_as_the_defaults(tmp_path):
    """Before, `helm upgrade --reuse-values` from the last release (c17c866) failed: Helm
    renders with that release's values (the old chart's values.yaml as the defaults), which
    have no uninstallHook, and the templates read .Values.uninstallHook.enabled (nil pointer).
    Now the block is read over its defaults: the hook renders as by default (120 s), and the
    policy that narrows its account and the NOTES' line with it."""
    chart = tmp_path / "kai-fractions"
    shutil.copytree(CHART, chart)
    shutil.copy(RELEASED_VALUES, chart / "values.yaml")
    assert "uninstallHook" not in yaml.safe_load(RELEASED_VALUES.read_text())
    args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, "--is-upgrade"]
    for value in IMAGE_SETS:
        args += ["--set", value]
    proc = helm(*args)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    job = hook_objects(docs)["Job"]
    assert "--wait-seconds=120" in container(job, "retire-nodes")["args"]
    assert job["spec"]["activeDeadlineSeconds"] == 240
    assert container(job, "retire-nodes")["resources"] == {
        "requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}
    one(docs, "ValidatingAdmissionPolicy", f"{NAME}-node-status")
    notes = helm("install", RELEASE, str(chart), "--namespace", NAMESPACE, "--dry-run=client",
                 "--set", IMAGE_SETS[0])
    assert notes.returncode == 0, notes.stderr
    assert "Uninstalling: a pre-delete hook" in notes.stdout
    # and to Disabled: the pre-upgrade hook, as with the current values
    proc = helm(*args, "--set", "gpuSharing=Disabled", "--set", AGENTS_RUN)
    assert proc.returncode == 0, proc.stderr
    hook = hook_objects([d for d in yaml.safe_load_all(proc.stdout) if d])
    assert "--wait-seconds=120" in container(hook["Job"], "retire-nodes")["args"]


def test_wait_seconds_is_checked():
    err = template_error("uninstallHook.waitSeconds=-1")
    assert "/uninstallHook/waitSeconds" in err
    # Below the agents' 75 s grace to stop, the wait would end before they could publish False:
    # their binding would be taken and every uninstall would fail.
    for short in (0, 60, 89):
        err = template_error(f"uninstallHook.waitSeconds={short}")
        assert "/uninstallHook/waitSeconds" in err and "90" in err, short
    docs = render(None, ("uninstallHook.waitSeconds=300",))
    job = hook_objects(docs)["Job"]
    assert job["spec"]["activeDeadlineSeconds"] == 420
    assert "--wait-seconds=300" in container(job, "retire-nodes")["args"]


def test_the_command_stops_before_the_job_is_killed():
    """Before: the Job's activeDeadlineSeconds killed a run still going (PATCHes that hang,
    thousands of nodes) with a log that said nothing of what was left. Now the command gets a
    deadline of its own, 30 s before the Job's (whose clock also counts the image pull), at
    which it stops and says what is left."""
    for wait in (90, 120, 300):
        job = hook_objects(render(None, (f"uninstallHook.waitSeconds={wait}",)))["Job"]
        args = container(job, "retire-nodes")["args"]
        assert f"--deadline-seconds={job['spec']['activeDeadlineSeconds'] - 30}" in args, wait
        assert f"--wait-seconds={wait}" in args


# -- what its service account may write on a Node ---------------------------------------------

@pytest.fixture(scope="module")
def pol() -> dict:
    return one(render(), "ValidatingAdmissionPolicy", f"{NAME}-node-status")


def ready_node() -> dict:
    def ready(n):
        for kind in (k.NODE_CONDITION, k.LEGACY_NODE_CONDITION):
            condition(n, kind).update(status="True", reason="AgentReady")
    return changed(node(), ready)


def retired(n: dict) -> None:
    for kind in (k.NODE_CONDITION, k.LEGACY_NODE_CONDITION):
        condition(n, kind).update(status="Unknown", reason="KaiFractionsUninstalled",
                                  lastTransitionTime=condition_time(0))


def test_the_hook_may_set_our_conditions_unknown_and_nothing_else(pol):
    """Before, a nodes/status write of the hook's account that left the status alone but
    relabelled the Node, or gave it an owner that does not exist (the garbage collector then
    deletes the Node), passed: the policy read only status.*. Now labels, annotations, owner
    references and finalizers are refused too, each naming the field; setting our conditions
    Unknown still passes."""
    old = ready_node()
    assert review(pol, old, changed(old, retired), "nodes/status", user=HOOK_USER) == []
    for edit, resource, message in (
            (lambda n: condition(n, k.NODE_CONDITION).update(status="False"), "nodes/status",
             "only to Unknown"),
            (lambda n: condition(n, "Ready").update(status="False"), "nodes/status",
             "may change only the conditions"),
            (lambda n: n["status"]["capacity"].update({"nvidia.com/gpu": "8"}),
             "nodes/status", "may change only the conditions"),
            (lambda n: n["metadata"]["labels"].update(x="y"), "nodes",
             "may update only a Node's status"),
            *((edit, "nodes/status", message) for edit, message in METADATA_EDITS)):
        found = review(pol, old, changed(old, edit), resource, user=HOOK_USER)
        assert any(message in m and "uninstall hook" in m for m in found), found
        # the same edit beside the one it may make: still refused
        found = review(pol, old, changed(changed(old, retired), edit), resource, user=HOOK_USER)
        assert any(message in m for m in found), found
    binding = one(render(), "ValidatingAdmissionPolicyBinding", f"{NAME}-node-status")
    assert binding["spec"] == {"policyName": f"{NAME}-node-status",
                               "validationActions": ["Deny"]}
    assert "helm.sh/hook" not in (pol["metadata"].get("annotations") or {})  # in force first


def test_the_policy_is_the_hooks_alone(pol):
    old = ready_node()
    # the agent sets its condition True again: not this policy's to judge
    assert review(pol, changed(old, retired), old, "nodes/status", user=AGENT_USER) == []

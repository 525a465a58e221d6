"""The chart lints, renders with every documented values file, and what it renders is valid
Kubernetes; the schema refuses bad values; each component is wired with the flags its CLI has."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from kai_fractions.cli import build_parser

from .render import (
    CHART,
    CI_VALUES,
    IMAGE_SETS,
    NAMESPACE,
    RELEASE,
    TEST_IMAGE,
    chart_notes,
    container,
    find,
    helm,
    kube_validate,
    one,
    render,
    render_text,
    template_error,
    values_id,
)
from .tls_memory import handshake

VALUES = (None, *CI_VALUES)
PATCHED_KAI_NAMESPACE = "kai-system"
SM_SHARING = CHART / "ci" / "sm-sharing-values.yaml"
TIME_SLICING = CHART / "ci" / "time-slicing-only-values.yaml"
DISABLED = CHART / "ci" / "disabled-values.yaml"
PROVIDED_TLS = CHART / "ci" / "provided-tls-values.yaml"
WATCHDOG_KILL = CHART / "ci" / "watchdog-kill-values.yaml"
# One extra render for the tests that need values no documented file sets.
CUSTOM = ("image.repository=registry.example.com/kf", "image.tag=1.2.3")
PATCHED = CHART / "ci" / "patched-kai-values.yaml"
WRITE_AS_BINDER = "kai-fractions-mirror-write-as-binder"  # the one Role (+ binding) in KAI's ns
MIRROR, AGENT, ADMISSION = ("kai-fractions-mirror", "kai-fractions-node-agent",
                            "kai-fractions-admission")


def test_documented_values_files_exist():
    assert {p.name for p in CI_VALUES} >= {
        "sm-sharing-values.yaml", "time-slicing-only-values.yaml", "disabled-values.yaml",
        "provided-tls-values.yaml", "watchdog-kill-values.yaml", "patched-kai-values.yaml"}
    for path in CI_VALUES:  # each says what it is for, first thing
        assert path.read_text().startswith("# "), f"{path.name} has no explaining comment"


@pytest.mark.parametrize("values_file", VALUES, ids=values_id)
def test_helm_lint_strict(values_file: Path | None):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    if values_file is not None:
        args += ["--values", str(values_file)]
    for value in IMAGE_SETS:
        args += ["--set", value]
    proc = helm(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values_file", VALUES, ids=values_id)
def test_rendered_manifests_pass_kubernetes_validate_strict(values_file: Path | None):
    docs = render(values_file)
    assert kube_validate(docs, values_id(values_file)) == []
    for doc in docs:  # everything namespaced lands in the release namespace...
        if doc["kind"] not in {"ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                               "ValidatingAdmissionPolicyBinding", "GpuFractioningConfig",
                               "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}:
            # ...but the right to impersonate KAI's binder, which lives where the binder does
            expected = (PATCHED_KAI_NAMESPACE if values_file == PATCHED else "kai-scheduler") \
                if doc["metadata"]["name"] == WRITE_AS_BINDER else NAMESPACE
            assert doc["metadata"]["namespace"] == expected, doc["metadata"]["name"]


def test_default_values_render_every_component():
    docs = render()
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted([
        ("ServiceAccount", MIRROR), ("ServiceAccount", AGENT), ("ServiceAccount", ADMISSION),
        ("ClusterRole", MIRROR), ("ClusterRoleBinding", MIRROR),
        ("Role", f"{MIRROR}-signing-key"), ("RoleBinding", f"{MIRROR}-signing-key"),
        ("Role", f"{MIRROR}-leader-election"), ("RoleBinding", f"{MIRROR}-leader-election"),
        ("Role", f"{MIRROR}-node-agent-status"), ("RoleBinding", f"{MIRROR}-node-agent-status"),
        # no Role in KAI's namespace: nothing to impersonate by default (mirror.writeAsBinder)
        ("GpuFractioningConfig", "default"),
        ("ValidatingAdmissionPolicy", f"{MIRROR}-node-status"),
        ("ValidatingAdmissionPolicyBinding", f"{MIRROR}-node-status"),
        ("ClusterRole", AGENT), ("ClusterRoleBinding", AGENT),
        ("Role", f"{AGENT}-heartbeat"), ("RoleBinding", f"{AGENT}-heartbeat"),
        ("ValidatingAdmissionPolicy", f"{AGENT}-own-node"),
        ("ValidatingAdmissionPolicyBinding", f"{AGENT}-own-node"),
        ("Deployment", MIRROR), ("Service", MIRROR), ("PodDisruptionBudget", MIRROR),
        ("NetworkPolicy", MIRROR), ("Secret", f"{MIRROR}-tls"),
        ("Secret", f"{MIRROR}-client-tls"),
        ("DaemonSet", AGENT),
        ("Deployment", ADMISSION), ("Service", ADMISSION), ("PodDisruptionBudget", ADMISSION),
        ("NetworkPolicy", ADMISSION), ("Secret", f"{ADMISSION}-tls"),
        ("MutatingWebhookConfiguration", ADMISSION),
        ("ValidatingWebhookConfiguration", ADMISSION),
        ("Secret", "kai-fractions-signing-key"),
        # the uninstall hook (pre-delete; uninstallHook.enabled) and its node-status policy
        *((kind, "kai-fractions-retire-nodes") for kind in (
            "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Job")),
        ("ValidatingAdmissionPolicy", "kai-fractions-retire-nodes-node-status"),
        ("ValidatingAdmissionPolicyBinding", "kai-fractions-retire-nodes-node-status"),
    ])


def test_disabled_renders_nothing_gpu_side():
    assert render(DISABLED) == []  # no DaemonSet, no webhooks, and no mirror writing promises


# -- schema ---------------------------------------------------------------------------------

def test_schema_rejects_wrong_case_enum():
    err = template_error("gpuSharing=nvfractions")
    assert "values don't meet the specifications of the schema" in err
    assert "/gpuSharing" in err and "'NvFractions', 'Disabled'" in err


def test_schema_rejects_string_where_a_number_belongs():
    err = template_error(set_string=["mirror.replicas=two", "watchdog.intervalSeconds=fast"])
    assert "/mirror/replicas" in err and "got string, want integer" in err
    assert "/watchdog/intervalSeconds" in err and "got string, want number" in err


def test_schema_rejects_a_follower_that_checks_nothing_at_once():
    err = template_error("mirror.followConcurrency=0")
    assert "/mirror/followConcurrency" in err and "minimum" in err


@pytest.mark.parametrize("prefix", ["kai-fractions.io/container.",
                                    "kai-fractions.io/container.team."])
def test_an_annotation_prefix_over_the_derived_keys_is_refused_with_the_rule(prefix):
    """The own-node policy lets the agent write the derived keys: with this prefix it could
    write the binder's too. The render fails with the rule and the fix, as the CLI words it
    (the schema's `not` said only "'not' failed")."""
    err = template_error(f"annotationPrefix={prefix}")
    assert (f"annotationPrefix={prefix} overlaps the keys kai_fractions derives "
            "('kai-fractions.io/container.'): give the scheduler's per-container prefix, such "
            "as 'nvidia.com/container.'") in err
    assert "'not' failed" not in err


def test_schema_rejects_an_annotation_prefix_of_the_wrong_shape():
    err = template_error("annotationPrefix=nvidia.com/container")
    assert "/annotationPrefix" in err and "does not match pattern" in err


def test_schema_rejects_webhook_paths_the_server_does_not_serve():
    """The admission server serves /validate and /mutate only: other paths rendered into the
    webhook configurations made every fractional pod's admission fail (a 404)."""
    err = template_error("webhook.paths.validate=/v1/validate")
    assert "/webhook/paths/validate" in err and "/validate" in err


@pytest.mark.parametrize("name", ["Ready", "MemoryPressure", "example/Ready"])
def test_schema_rejects_a_node_condition_of_the_kubelets_own(name: str) -> None:
    """A condition without a domain prefix is the kubelet's (Ready, MemoryPressure): the agent
    would fight the kubelet over it and the mirror could set the node's Ready Unknown."""
    err = template_error(f"nodeCondition.name={name}")
    assert "/nodeCondition/name" in err


@pytest.mark.parametrize(("sets", "message"), [
    (("hostPaths.markerDir=/run/kai-fractions",),
     "hostPaths.markerDir and hostPaths.socketDir are both /run/kai-fractions"),
    (("hostPaths.socketDir=/tmp",), "hostPaths.socketDir and the agent's /tmp are both /tmp"),
    (("hostPaths.cgroupRoot=/host/proc",),
     "hostPaths.cgroupRoot and the host's /proc are both /host/proc"),
    (("smSharing.enabled=true", "hostPaths.mpsLogDir=/run/kai-fractions/mps"),
     "hostPaths.mpsPipeDir and hostPaths.mpsLogDir are both /run/kai-fractions/mps"),
])
def test_host_paths_that_meet_in_the_agent_are_refused_naming_both(sets, message):
    """Two mounts at one path render, and the API server then refuses the DaemonSet naming
    only the path: the chart names the values."""
    err = template_error(*sets)
    assert f"{message} in the node agent's container" in err


def test_kai_reservation_namespace_reaches_the_follower_and_the_webhooks():
    docs = render(sets=("kaiScheduler.reservationNamespace=gpu-reservations",))
    assert "--reservation-namespace=gpu-reservations" in container(
        one(docs, "Deployment", MIRROR), "mirror")["args"]
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for hook in find(docs, kind)[0]["webhooks"]:
            excluded = hook["namespaceSelector"]["matchExpressions"][-1]
            assert excluded["values"][-1] == "gpu-reservations", hook["name"]
    err = template_error("kaiScheduler.reservationNamespace=KAI_Reservations")
    assert "/kaiScheduler/reservationNamespace" in err


def test_schema_rejects_unknown_keys_and_values():
    err = template_error("mirror.replica=3", "watchdog.policy=ignore",
                         "memoryEnforcement.tiers={cgroup,nvml}",
                         "annotationPrefix=no-slash.")
    assert "additional properties 'replica' not allowed" in err
    assert "/watchdog/policy" in err
    assert "/memoryEnforcement/tiers/1" in err
    assert "/annotationPrefix" in err


# -- mirror ---------------------------------------------------------------------------------

def _args(workload: dict, name: str) -> list[str]:
    return container(workload, name)["args"]


def test_mirror_deployment_defaults():
    docs = render()
    dep = one(docs, "Deployment", MIRROR)
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == MIRROR
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = container(dep, "mirror")
    assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["args"] == [
        "mirror", "--listen=0.0.0.0:50051", "--annotation-prefix=nvidia.com/container.",
        "--kai-dialect=upstream", "--reserve-mib=0",
        # no --write-as: the follower of an unmodified KAI writes as the mirror itself
        "--follow-bindrequests", "--leader-elect",
        f"--leader-elect-lease-name={MIRROR}-follower", "--follow-concurrency=8",
        "--reservation-namespace=kai-resource-reservation",
        "--mark-silent-nodes-after=180", "--heartbeat-lease-namespace=kai-fractions",
        "--node-condition=gpu-fractioning.nvidia.com/Ready",
        "--node-condition=gpu-sharing.nvidia.com/Ready",
        "--scheduler-name=kai-scheduler",
        "--tls-cert=/etc/kai-fractions/tls/tls.crt", "--tls-key=/etc/kai-fractions/tls/tls.key",
        # mirror.auth=mutualTLS by default: callers need the generated client certificate
        "--tls-client-ca=/etc/kai-fractions/tls/ca.crt",
        "--report-gpu-fractioning-config",
        "--node-agent-daemonset=kai-fractions/kai-fractions-node-agent", "--report-interval=10",
        "--signing-key-file=/etc/kai-fractions/signing",
        "--publish-public-key=kai-fractions/kai-fractions-signing-public",
        "--metrics-listen=0.0.0.0:9401", "--log-level=info"]
    assert c["ports"] == [{"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": 9401, "protocol": "TCP"}]
    tls = next(v for v in pod["volumes"] if v["name"] == "tls")
    assert tls["secret"]["secretName"] == f"{MIRROR}-tls"
    pdb = one(docs, "PodDisruptionBudget", MIRROR)
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    svc = one(docs, "Service", MIRROR)
    assert svc["spec"]["ports"][0]["port"] == 50051
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    netpol = one(docs, "NetworkPolicy", MIRROR)
    assert netpol["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert netpol["spec"]["ingress"] == [
        {"ports": [{"port": "grpc", "protocol": "TCP"}],
         "from": [{"namespaceSelector": {
             "matchLabels": {"kubernetes.io/metadata.name": "kai-scheduler"}}}]},
        # the metrics (no secrets) from anywhere: mirror.networkPolicy.metricsFrom is []
        {"ports": [{"port": "metrics", "protocol": "TCP"}]}]


def test_mirror_dialect_and_reserve():
    def dialect_and_reserve(docs):
        return [a for a in _args(one(docs, "Deployment", MIRROR), "mirror")
                if a.startswith(("--kai-dialect=", "--reserve-mib="))]
    # upstream KAI subtracts nothing, with MPS or without: no reserve by default anywhere
    for values_file in (None, TIME_SLICING, SM_SHARING, WATCHDOG_KILL):
        assert dialect_and_reserve(render(values_file)) == [
            "--kai-dialect=upstream", "--reserve-mib=0"], values_id(values_file)
    # the patched binder's reserve is an explicit setting
    assert dialect_and_reserve(render(PATCHED)) == ["--kai-dialect=patched", "--reserve-mib=1024"]


def test_schema_rejects_a_reserve_with_the_upstream_dialect():
    err = template_error("mirror.reserveMiB=1024")
    assert "values don't meet the specifications of the schema" in err
    assert "/mirror/reserveMiB" in err and "value must be 0" in err
    err = template_error("kaiScheduler.dialect=patched", "mirror.reserveMiB=-1")
    assert "/mirror/reserveMiB" in err
    err = template_error("kaiScheduler.dialect=Upstream")
    assert "/kaiScheduler/dialect" in err and "'upstream', 'patched'" in err


def test_mirror_writes_as_kai_binder_only_when_told_to():
    """Least privilege by default: only the gRPC path (a caller of MirrorAllocation) needs the
    mirror to write .gpus.devices as KAI's binder; the follower of an unmodified KAI writes its
    signature as the mirror itself (kai_fractions/cli/mirror_background.py). So neither the
    flag nor the impersonation Role in KAI's namespace is rendered unless asked for."""
    def write_as(docs):
        return [a for a in _args(one(docs, "Deployment", MIRROR), "mirror")
                if a.startswith("--write-as")]
    for docs in (render(), render(sets=("mirror.writeAsBinder=false",))):
        assert write_as(docs) == []
        assert not find(docs, "Role", WRITE_AS_BINDER)
        assert not find(docs, "RoleBinding", WRITE_AS_BINDER)
        assert not [d for d in docs if d["metadata"].get("namespace") == "kai-scheduler"]
    on = ("mirror.writeAsBinder=true",)
    assert write_as(render(sets=on)) == ["--write-as=system:serviceaccount:kai-scheduler:binder"]
    assert one(render(sets=on), "Role", WRITE_AS_BINDER)["metadata"]["namespace"] == \
        "kai-scheduler"
    # the gRPC mode's documented values file (a patched KAI, in kai-system) turns it on
    assert write_as(render(PATCHED)) == ["--write-as=system:serviceaccount:kai-system:binder"]
    assert write_as(render(sets=(*on, "kaiScheduler.binderServiceAccount=kai-binder"))) == [
        "--write-as=system:serviceaccount:kai-scheduler:kai-binder"]


def test_mirror_pod_cache_follows_the_scheduler_name_or_is_off():
    def cache_args(*sets):
        return [a for a in _args(one(render(sets=sets), "Deployment", MIRROR), "mirror")
                if a.startswith(("--scheduler-name", "--no-pod-cache"))]
    assert cache_args() == ["--scheduler-name=kai-scheduler"]
    assert cache_args("mirror.schedulerName=kai-scheduler-gpu") == [
        "--scheduler-name=kai-scheduler-gpu"]
    assert cache_args("mirror.podCache=false") == ["--no-pod-cache"]


def test_mirror_mutual_tls_with_generated_client_certificate():
    docs = render(SM_SHARING)
    assert "--tls-client-ca=/etc/kai-fractions/tls/ca.crt" in _args(
        one(docs, "Deployment", MIRROR), "mirror")
    server = one(docs, "Secret", f"{MIRROR}-tls")["data"]
    client = one(docs, "Secret", f"{MIRROR}-client-tls")["data"]
    assert server["ca.crt"] == client["ca.crt"]  # one CA signs both ends
    _assert_tls_handshake(server, client["ca.crt"], f"{MIRROR}.{NAMESPACE}.svc")


def test_provided_tls_and_token():
    docs = render(PROVIDED_TLS)
    assert not find(docs, "Secret", f"{MIRROR}-tls")
    assert not find(docs, "Secret", f"{ADMISSION}-tls")
    dep = one(docs, "Deployment", MIRROR)
    args = _args(dep, "mirror")
    assert "--tls-client-ca=/etc/kai-fractions/tls/ca.crt" in args
    assert "--token-file=/etc/kai-fractions/token/token" in args
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "kai-fractions-mirror-certs"
    assert volumes["token"]["secret"]["secretName"] == "kai-fractions-mirror-token"
    adm = one(docs, "Deployment", ADMISSION)
    volumes = {v["name"]: v for v in adm["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "kai-fractions-admission-certs"


# -- node agent -----------------------------------------------------------------------------

def test_node_agent_daemonset_defaults():
    ds = one(render(), "DaemonSet", AGENT)
    pod = ds["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["serviceAccountName"] == AGENT
    # the host's pids always (NVML shows only the GPU processes of the caller's pid namespace);
    # no MPS: no host IPC
    assert pod["hostPID"] is True and pod["hostIPC"] is False
    c = container(ds, "node-agent")
    assert c["args"] == [
        "node-agent", "--node-name=$(NODE_NAME)", "--socket=/run/kai-fractions/agent.sock",
        "--marker-dir=/var/lib/kai-fractions/markers", "--cgroup-root=/sys/fs/cgroup",
        "--cgroup-driver=systemd", "--proc-root=/host/proc", "--no-sm-sharing",
        "--mps-pipe-dir=/run/kai-fractions/mps", "--mps-log-dir=/var/log/kai-fractions/mps",
        "--mps-drain-before-kill=3",
        # mps-pinned is dropped without MPS: it applies to MPS clients only
        "--memory-enforcement=cgroup,watchdog", "--watchdog-policy=report",
        "--watchdog-interval=1", "--metrics-listen=0.0.0.0:9400",
        "--condition-name=gpu-fractioning.nvidia.com/Ready",
        "--heartbeat-lease-namespace=kai-fractions", "--legacy-condition",
        "--resync-seconds=300", "--first-list-jitter=2",
        "--signing-key-file=/etc/kai-fractions/signing",
        "--annotation-prefix=nvidia.com/container.", "--log-level=info"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert c["securityContext"] == {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False,
                                    "privileged": True}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    def host(name):
        return (volumes[name]["hostPath"]["path"], mounts[name]["mountPath"],
                mounts[name].get("readOnly", False))
    assert host("cgroup") == ("/sys/fs/cgroup", "/sys/fs/cgroup", True)
    assert host("host-proc") == ("/proc", "/host/proc", True)
    assert host("markers") == ("/var/lib/kai-fractions/markers",
                               "/var/lib/kai-fractions/markers", False)
    assert host("socket-dir") == ("/run/kai-fractions", "/run/kai-fractions", False)
    assert "mps-pipe" not in volumes and "mps-log" not in volumes
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in c["ports"]


def test_signing_needs_the_mirror():
    """Only the chart's mirror signs and publishes the public key the node agents mount: signing
    without it would leave every agent in ContainerCreating, so the render fails, naming both
    values and the ways out."""
    err = template_error("mirror.enabled=false", "gpuFractioningConfig.enabled=false")
    assert "signing.enabled needs mirror.enabled" in err
    assert "ConfigMap kai-fractions-signing-public" in err
    assert "Set signing.enabled=false" in err and "keep mirror.enabled=true" in err
    docs = render(sets=("mirror.enabled=false", "gpuFractioningConfig.enabled=false",
                        "signing.enabled=false"))
    args = container(one(docs, "DaemonSet", AGENT), "node-agent")["args"]
    assert not [a for a in args if a.startswith("--signing-key-file")]
    assert not find(docs, "Secret", "kai-fractions-signing-key")


def test_node_agent_has_time_to_stop_before_the_kubelets_sigkill():
    """Each step of its shutdown is bounded; the grace period covers their worst cases added up
    (it was 30 s: a task in progress and its own MPS daemon's quit and kill alone take 35)."""
    import inspect

    from kai_fractions.kube.blocking import BlockingKube
    from kai_fractions.kube.client import Kube
    from kai_fractions.node.agent.agent import NodeAgent
    from kai_fractions.node.agent.grpc_service import close_unix
    from kai_fractions.node.mps.daemon import MpsDaemon

    def default(function, name: str) -> float:
        return inspect.signature(function).parameters[name].default

    worst = (default(NodeAgent.stop, "timeout")  # the task in progress
             + 2 * 2.0  # the watcher's and the status threads' joins
             + 2 * default(Kube.__init__, "request_timeout")  # the condition's last publish
             + default(close_unix, "grace")
             + 3 * default(MpsDaemon.__init__, "stop_grace")  # quit, SIGKILL, each waited
             + default(BlockingKube.close, "timeout"))
    pod = one(render(), "DaemonSet", AGENT)["spec"]["template"]["spec"]
    assert worst <= pod["terminationGracePeriodSeconds"], worst


def test_node_agent_lists_from_the_watch_cache_when_asked():
    """docs/scale.md: large clusters list from the API server's watch cache."""
    args = container(one(render(sets=("nodeAgent.listFromWatchCache=true",
                                      "nodeAgent.firstListJitterSeconds=5")),
                         "DaemonSet", AGENT), "node-agent")["args"]
    assert "--list-from-watch-cache" in args and "--first-list-jitter=5" in args
    default = container(one(render(), "DaemonSet", AGENT), "node-agent")["args"]
    assert "--list-from-watch-cache" not in default


def test_node_agent_drains_mps_clients_before_the_kill_as_the_values_say():
    """docs/node-agent.md, "Stopping an sm-sharing pod": the margin reaches the agent."""
    args = container(one(render(SM_SHARING, sets=("nodeAgent.mpsDrainBeforeKillSeconds=7",)),
                         "DaemonSet", AGENT), "node-agent")["args"]
    assert "--mps-drain-before-kill=7" in args and "--sm-sharing" in args
    off = container(one(render(SM_SHARING, sets=("nodeAgent.mpsDrainBeforeKillSeconds=0",)),
                        "DaemonSet", AGENT), "node-agent")["args"]
    assert "--mps-drain-before-kill=0" in off
    err = template_error("nodeAgent.mpsDrainBeforeKillSeconds=-1")
    assert "/nodeAgent/mpsDrainBeforeKillSeconds" in err and "minimum" in err


def test_node_agent_with_mps():
    ds = one(render(SM_SHARING), "DaemonSet", AGENT)
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["hostIPC"] is True
    c = container(ds, "node-agent")
    assert "--sm-sharing" in c["args"]
    assert "--memory-enforcement=cgroup,mps-pinned,watchdog" in c["args"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert volumes["mps-pipe"] == mounts["mps-pipe"] == "/run/kai-fractions/mps"
    assert volumes["mps-log"] == mounts["mps-log"] == "/var/log/kai-fractions/mps"


def test_node_agent_capabilities_instead_of_privileged():
    docs = render(WATCHDOG_KILL)
    ds = one(docs, "DaemonSet", AGENT)
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True  # the kill policy signals workload processes by host PID
    c = container(ds, "node-agent")
    assert c["securityContext"] == {
        "runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN", "KILL", "SETUID", "SETGID",
                                                   "CHOWN", "FOWNER", "DAC_OVERRIDE"]},
        "seccompProfile": {"type": "RuntimeDefault"}}
    args = c["args"]
    assert "--memory-enforcement=mps-pinned,watchdog" in args
    assert "--watchdog-policy=kill" in args and "--watchdog-interval=0.5" in args
    assert "--legacy-condition" not in args and "--publish-gpu-memory-label" in args
    assert "--cgroup-driver=cgroupfs" in args
    monitor = one(docs, "ServiceMonitor", AGENT)
    svc = one(docs, "Service", f"{AGENT}-metrics")
    assert svc["spec"]["clusterIP"] == "None"
    assert monitor["spec"]["selector"]["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


@pytest.mark.parametrize("values_file", [v for v in VALUES if v != DISABLED], ids=values_id)
def test_node_agent_always_shares_the_host_pid_namespace(values_file: Path | None):
    """NVML reports only the GPU processes of the caller's pid namespace: in one of its own the
    agent's watchdog would see no container's process (nothing measured, reported or stopped),
    whatever the policy or MPS say. Host IPC stays with sm-sharing only."""
    docs = render(values_file)
    pod = one(docs, "DaemonSet", AGENT)["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    sm = "--sm-sharing" in container(one(docs, "DaemonSet", AGENT), "node-agent")["args"]
    assert pod["hostIPC"] is sm


def test_memory_tiers_that_leave_nothing_fail_with_a_reason():
    err = template_error("memoryEnforcement.tiers={mps-pinned}")
    assert "memoryEnforcement.tiers=mps-pinned (smSharing.enabled=false" in err
    assert "no tier left that caps GPU memory" in err


@pytest.mark.parametrize("tiers", ["{mps-pinned,watchdog}", "{watchdog}"])
def test_a_report_watchdog_is_no_tier_that_caps(tiers):
    """A watchdog with policy report (the default) stops nothing: with no other tier that caps,
    every node agent refuses every fractional pod (MemoryLimitsUnsupported), so the chart
    refuses the values and names the three ways out instead of rendering them."""
    err = template_error(f"memoryEnforcement.tiers={tiers}")
    assert "watchdog.policy=report): no tier left that caps GPU memory" in err
    for way_out in ("Add cgroup to memoryEnforcement.tiers",
                    "smSharing.enabled=true with mps-pinned", "watchdog.policy=kill"):
        assert way_out in err
    # a kill watchdog caps on its own, and mps-pinned does with sm-sharing
    args = container(one(render(sets=(f"memoryEnforcement.tiers={tiers}",
                                      "watchdog.policy=kill")), "DaemonSet", AGENT),
                     "node-agent")["args"]
    assert "--memory-enforcement=watchdog" in args  # mps-pinned dropped: no sm-sharing
    if "mps-pinned" in tiers:
        args = container(one(render(sets=(f"memoryEnforcement.tiers={tiers}",
                                          "smSharing.enabled=true")), "DaemonSet", AGENT),
                         "node-agent")["args"]
        assert "--memory-enforcement=mps-pinned,watchdog" in args


# -- admission ------------------------------------------------------------------------------

def test_admission_deployment():
    docs = render()
    dep = one(docs, "Deployment", ADMISSION)
    pod = dep["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = container(dep, "admission")
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["args"] == [
        "admission", "--listen=0.0.0.0:8443", "--metrics-listen=0.0.0.0:9402",
        "--tls-cert=/etc/kai-fractions/tls/tls.crt", "--tls-key=/etc/kai-fractions/tls/tls.key",
        "--allowed-identity=system:serviceaccount:kai-scheduler:binder",
        f"--allowed-identity=system:serviceaccount:{NAMESPACE}:{MIRROR}",
        f"--allowed-identity=system:serviceaccount:{NAMESPACE}:{AGENT}",
        f"--gate-image={TEST_IMAGE}:0.1.0",
        "--marker-host-dir=/var/lib/kai-fractions/markers",
        "--mps-pipe-host-dir=/run/kai-fractions/mps", "--agent-socket-dir=/run/kai-fractions",
        "--kubelet-root-dir=/var/lib/kubelet",
        "--annotation-prefix=nvidia.com/container.",
        "--condition-name=gpu-fractioning.nvidia.com/Ready", "--scheduler-name=kai-scheduler",
        "--shutdown-delay=5", "--log-level=info"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "https",
                                              "scheme": "HTTPS"}
    # a replica stopping keeps answering for the delay (its /healthz 503), then up to 15 s for
    # the reviews in flight: the kubelet waits for both before SIGKILL
    assert pod["terminationGracePeriodSeconds"] == 25
    assert c["env"] == [{"name": "MALLOC_ARENA_MAX", "value": "2"}]
    assert c["resources"]["limits"] == {"memory": "384Mi"}  # the measured worst case fits
    longer = one(render(sets=("webhook.shutdownDelaySeconds=20",)), "Deployment", ADMISSION)
    assert longer["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 40
    assert "/webhook/shutdownDelaySeconds" in template_error("webhook.shutdownDelaySeconds=31")
    assert one(docs, "PodDisruptionBudget", ADMISSION)["spec"]["minAvailable"] == 1
    # where the NVIDIA runtime is a RuntimeClass, fractional pods are given it
    nvidia = container(one(render(sets=("webhook.runtimeClassName=nvidia",)), "Deployment",
                           ADMISSION), "admission")["args"]
    assert nvidia[-4:] == ["--runtime-class=nvidia", "--scheduler-name=kai-scheduler",
                           "--shutdown-delay=5", "--log-level=info"]
    # fractional pods of another scheduler are warned of: KAI's, as the mirror names it
    renamed = container(one(render(sets=("mirror.schedulerName=kai",)), "Deployment",
                            ADMISSION), "admission")["args"]
    assert "--scheduler-name=kai" in renamed
    assert "/webhook/runtimeClassName" in template_error("webhook.runtimeClassName=NVIDIA")
    # the kubelet's pods directory (guarded like kai-fractions' own) follows the nodes' kubelet
    moved = container(one(render(sets=(
        "webhook.kubeletRootDir=/var/snap/microk8s/common/var/lib/kubelet",)), "Deployment",
        ADMISSION), "admission")["args"]
    assert "--kubelet-root-dir=/var/snap/microk8s/common/var/lib/kubelet" in moved
    for bad in ("/", "var/lib/kubelet", "/var/lib/kubelet/"):
        assert "/webhook/kubeletRootDir" in template_error(f"webhook.kubeletRootDir={bad}"), bad
    svc = one(docs, "Service", ADMISSION)
    assert svc["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": "https",
                                     "protocol": "TCP"}]


def test_generated_webhook_certificate_is_trusted_by_its_ca_bundle():
    docs = render()
    secret = one(docs, "Secret", f"{ADMISSION}-tls")
    assert secret["type"] == "kubernetes.io/tls"
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        for hook in one(docs, kind, ADMISSION)["webhooks"]:
            assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"], hook["name"]
    _assert_tls_handshake(secret["data"], secret["data"]["ca.crt"],
                          f"{ADMISSION}.{NAMESPACE}.svc")


# -- every component's flags exist in its real CLI -----------------------------------------

COMPONENTS = {"mirror": ("Deployment", MIRROR), "node-agent": ("DaemonSet", AGENT),
              "admission": ("Deployment", ADMISSION)}


@pytest.mark.parametrize("component", COMPONENTS)
@pytest.mark.parametrize("values_file", [v for v in VALUES if v != DISABLED], ids=values_id)
def test_rendered_args_parse_with_the_real_cli(values_file: Path | None, component: str):
    kind, name = COMPONENTS[component]
    args = _args(one(render(values_file), kind, name), component)
    assert args[0] == component
    try:
        build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{kind}/{name}: `kai-fractions {shlex.join(args)}` is refused by the "
                    f"CLI (exit {e.code})")


def test_image_and_gate_image_follow_values():
    docs = render(SM_SHARING, CUSTOM)
    for w in (d for d in docs if d["kind"] in ("Deployment", "DaemonSet")):
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert c["image"] == "registry.example.com/kf:1.2.3"
    assert "--gate-image=registry.example.com/kf:1.2.3" in _args(
        one(docs, "Deployment", ADMISSION), "admission")
    assert "registry.example.com/kf:1.2.3" not in render_text()


def test_image_repository_must_be_set():
    """The project publishes no image: without image.repository (empty, or the old placeholder)
    every pod would pull an image nobody published while both pod webhooks fail closed with no
    server behind them. The render fails, naming the value and how to set it."""
    for error in (template_error(image=False), template_error("image.repository="),
                  template_error("image.repository= "),
                  template_error("image.repository=ghcr.io/kai-fractions/kai-fractions")):
        assert "image.repository must be set to the registry you pushed the kai-fractions " \
            "image to" in error, error
        assert "--set image.repository=<registry>/kai-fractions,image.tag=<version>" in error
    assert "ghcr.io/kai-fractions/kai-fractions is only a placeholder" in template_error(
        "image.repository=ghcr.io/kai-fractions/kai-fractions")
    # nothing pulls the image with gpuSharing=Disabled: it renders (nothing) without one
    assert render(DISABLED, image=False) == []
    assert "nothing was deployed" in helm(
        "install", "kf", str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
        "--values", str(DISABLED)).stdout


@pytest.mark.parametrize(("component", "value", "name"), [
    ("mirror", "mirror.replicas", MIRROR), ("admission", "webhook.replicas", ADMISSION)])
def test_no_disruption_budget_that_would_block_a_drain(component: str, value: str, name: str):
    """minAvailable 1 over a single replica lets no eviction through: `kubectl drain` of its node
    would wait for ever. With one replica no budget is rendered; with two or more it is."""
    assert not find(render(sets=(f"{value}=1",)), "PodDisruptionBudget", name)
    pct = f"{value.split('.')[0]}.podDisruptionBudget.minAvailable=50%"
    assert not find(render(sets=(f"{value}=1", pct)), "PodDisruptionBudget", name)
    for replicas in (2, 3):
        pdb = one(render(sets=(f"{value}={replicas}",)), "PodDisruptionBudget", name)
        assert pdb["spec"]["minAvailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"][
            "app.kubernetes.io/component"] == component
    off = f"{value.split('.')[0]}.podDisruptionBudget.enabled=false"
    assert not find(render(sets=(off,)), "PodDisruptionBudget", name)
    # A budget set by hand to let no pod go is refused, naming both values.
    prefix = value.split(".")[0]
    for replicas, least in ((2, "2"), (2, "3"), (3, "3")):
        error = template_error(f"{value}={replicas}",
                               f"{prefix}.podDisruptionBudget.minAvailable={least}")
        assert (f"{prefix}.podDisruptionBudget.minAvailable={least} with {value}={replicas} "
                "lets no pod be evicted") in error, error
    kept = one(render(sets=(f"{value}=3", f"{prefix}.podDisruptionBudget.minAvailable=2")),
               "PodDisruptionBudget", name)
    assert kept["spec"]["minAvailable"] == 2


@pytest.mark.parametrize(("value", "name"), [("mirror.replicas", MIRROR),
                                             ("webhook.replicas", ADMISSION)])
def test_a_percentage_budget_is_checked_as_kubernetes_rounds_it(value: str, name: str):
    """The disruption controller rounds a percentage minAvailable UP (intstr.
    GetScaledValueFromIntOrPercent(..., roundUp=true)): 75% of 2 replicas is 2, which lets no
    pod be evicted, exactly as minAvailable 2 would; the check skipped percentages."""
    prefix = value.split(".")[0]
    budget = f"{prefix}.podDisruptionBudget.minAvailable"
    for replicas, pct, least in ((2, 75, 2), (2, 51, 2), (2, 100, 2), (3, 67, 3), (3, 99, 3),
                                 (4, 76, 4), (10, 91, 10)):
        error = template_error(f"{value}={replicas}", f"{budget}={pct}%")
        assert (f"{budget}={pct}% with {value}={replicas} lets no pod be evicted (Kubernetes "
                f"rounds a percentage up: {pct}% of {replicas} replicas is {least})") in error, \
            error
        # the message names the largest percentage that leaves room
        most = (replicas - 1) * 100 // replicas
        assert f"a percentage no more than {most}%" in error
        # ...which renders, with one eviction left (ceil(most * replicas / 100) < replicas)
        assert -(-most * replicas // 100) < replicas
        kept = one(render(sets=(f"{value}={replicas}", f"{budget}={most}%")),
                   "PodDisruptionBudget", name)
        assert kept["spec"]["minAvailable"] == f"{most}%"
    for replicas, pct in ((2, 50), (2, 0), (3, 66), (3, 34)):
        assert one(render(sets=(f"{value}={replicas}", f"{budget}={pct}%")),
                   "PodDisruptionBudget", name)


# -- helpers --------------------------------------------------------------------------------

def _assert_tls_handshake(server_data: dict, ca_b64: str, hostname: str) -> None:
    """A client that trusts only `ca_b64` completes a TLS handshake with the server's
    certificate for `hostname` (the Service DNS name the API server or a caller uses): the
    certificate chains to the CA, names the host, and matches its key."""
    assert handshake(server_data, ca_b64, hostname) is None


def test_an_image_pinned_by_digest_and_a_repository_with_a_tag():
    digest = "sha256:" + "ab" * 32
    docs = render(sets=(f"image.tag={digest}",))
    images = {c["image"] for d in docs if d["kind"] in ("Deployment", "DaemonSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {f"{TEST_IMAGE}@{digest}"}
    err = template_error("image.repository=registry.example.com:5000/kf:1.0")
    assert ("image.repository=registry.example.com:5000/kf:1.0 carries a tag or digest: give "
            "the repository alone") in err


# -- NOTES.txt ------------------------------------------------------------------------------

def test_notes_tell_how_to_check_it_works():
    notes = chart_notes()
    assert "--set global.gpuSharingMode=NvFractions" in notes
    # never the switch that installs the upstream gpu-fractioning operator as well
    assert "global.nvFractions.set=true" not in notes
    assert "Do not set KAI's global.nvFractions.set" in notes
    assert "KAI dialect: upstream (KAI main: no compute portion, no reserve)" in notes
    # no impersonation by default, and NOTES say exactly when to turn it on
    assert "mirror.writeAsBinder=false: the mirror writes as its own account" in notes
    assert ("calls the mirror's gRPC\nMirrorAllocation, set mirror.writeAsBinder=true: KAI's "
            "NvFractions webhook lets only\nsystem:serviceaccount:kai-scheduler:binder write "
            ".gpus.devices") in notes
    on = chart_notes("mirror.writeAsBinder=true")
    assert "impersonate KAI's binder, system:serviceaccount:kai-scheduler:binder" in on
    assert "kubectl get gpufractioningconfigs default" in notes
    assert ('[?(@.type=="DependenciesFulfilled")]}{.status}: {.message}' in notes)
    assert ('.status.conditions[?(@.type=="gpu-fractioning.nvidia.com/Ready")].status'
            in notes)
    assert "kubectl get nodes -l nvidia.com/gpu.present=true" in notes
    assert "kubectl apply -f examples/memory-request.yaml" in notes
    assert "kai-fractions inspect node <node-name> --release-namespace kai-fractions" in notes
    # -n of inspect pod is the pod's namespace (kubectl's); the Leases' is --release-namespace
    assert ("kai-fractions inspect pod memory-request -n default --release-namespace "
            "kai-fractions") in notes
    assert "kai-fractions inspect mirror -n kai-fractions" in notes
    assert "memory tiers: cgroup,watchdog" in notes
    assert "inspect mirror" not in chart_notes("mirror.enabled=false",
                                               "gpuFractioningConfig.enabled=false",
                                               "signing.enabled=false")


def _notes_inspect_args(notes: str) -> list:
    """The `kai-fractions inspect node|pod` commands of the NOTES, as the real CLI parses them."""
    commands = [line.strip() for line in notes.splitlines()
                if line.strip().startswith(("kai-fractions inspect node",
                                            "kai-fractions inspect pod"))]
    assert len(commands) == 2, commands
    return [build_parser().parse_args(shlex.split(c)[1:]) for c in commands]


def test_notes_inspect_commands_read_the_condition_and_keys_the_chart_writes():
    """inspect reads the node condition and per-container keys by name: with a nodeCondition.name
    or annotationPrefix other than its defaults, a NOTES command without them would report a
    healthy node as one no agent runs on. The defaults are the CLI's, so they are left out."""
    for args in _notes_inspect_args(chart_notes()):
        assert args.condition_name == "gpu-fractioning.nvidia.com/Ready"
        assert args.annotation_prefix == "nvidia.com/container."
    notes = chart_notes("nodeCondition.name=gpu.example.com/Ready",
                        "annotationPrefix=example.com/container.")
    for args in _notes_inspect_args(notes):
        assert args.condition_name == "gpu.example.com/Ready"
        assert args.annotation_prefix == "example.com/container."
        assert args.release_namespace == NAMESPACE
    assert "--condition-name" not in chart_notes()


def test_notes_warn_when_the_grpc_path_is_all_and_cannot_write_as_the_binder():
    """Without the follower, MirrorAllocation is the mirror's only way to write, and KAI's
    webhook refuses its .gpus.devices unless it writes as the binder."""
    notes = chart_notes("mirror.followBindRequests=false")
    assert ("WARNING: mirror.followBindRequests=false leaves the gRPC MirrorAllocation as the "
            "mirror's only\nway to write") in notes
    assert "set mirror.writeAsBinder=true." in notes
    assert "WARNING: mirror.followBindRequests" not in chart_notes(
        "mirror.followBindRequests=false", "mirror.writeAsBinder=true")


def test_notes_tell_to_exempt_trusted_host_agents_and_read_the_env_of_a_finished_pod():
    notes = chart_notes()
    assert "reviews EVERY pod with a hostPath volume" in notes
    # with this release's own name and namespace, keeping what was installed
    assert (f"helm upgrade {RELEASE} <chart> -n {NAMESPACE} --reuse-values --set "
            "'webhook.hostPathExemptNamespaces={monitoring,gpu-operator}'") in notes
    assert "kai-fractions.io/webhook=disabled" in notes
    exempt = chart_notes("webhook.hostPathExemptNamespaces={monitoring,gpu-operator}")
    assert ("Exempt for pods without NvFractions keys (webhook.hostPathExemptNamespaces): "
            "monitoring, gpu-operator.") in exempt
    # examples/memory-request.yaml exits in seconds (restartPolicy Never): no exec into it
    assert "kubectl exec" not in notes
    assert ("kubectl get pod memory-request -o jsonpath='{range .spec.containers"
            "[?(@.name==\"trainer\")].env[*]}") in notes
    assert "kubectl logs memory-request" in notes


def test_notes_tell_what_namespaces_that_run_fractions_need():
    """The gate (the chart's image) is pulled in the workloads' namespaces, which the chart's
    imagePullSecrets do not reach, and its hostPath needs Pod Security `privileged` there; the
    critical priority classes may be refused outside kube-system (GKE)."""
    notes = chart_notes("image.tag=1.2.3")
    assert f"- to pull {TEST_IMAGE}:1.2.3: the webhook adds it to every fractional pod" in notes
    assert "imagePullSecrets here\n  reach only this chart's pods" in notes
    assert "kubectl label namespace <namespace> pod-security.kubernetes.io/enforce=privileged" \
        in notes
    assert "set nodeAgent.priorityClassName / webhook.priorityClassName" in notes
    assert "priorityClassName" not in chart_notes("nodeAgent.priorityClassName=gpu-critical",
                                                  "webhook.priorityClassName=")


def test_notes_warn_of_alerts_without_the_scrapes_they_read():
    warned = chart_notes("prometheusRule.enabled=true")
    assert "NOTE: prometheusRule.enabled without serviceMonitor.enabled" in warned
    assert "KaiFractionsFollowerNoLeader fires all the time" in warned
    for sets in ((), ("prometheusRule.enabled=true", "serviceMonitor.enabled=true")):
        assert "without serviceMonitor.enabled" not in chart_notes(*sets), sets


def test_notes_say_when_nothing_is_deployed():
    notes = chart_notes(values_file=DISABLED)
    assert "gpuSharing=Disabled: nothing was deployed" in notes


def test_the_mps_pipe_dir_is_held_to_the_agents_length_limit_in_the_schema():
    """A hostPaths.mpsPipeDir the node agent refuses (its pipe directories' unix socket paths
    would not fit) rendered fine and crashed every agent, sm-sharing on or off: the schema
    refuses it, at exactly the agent's limit (chart review, session 22)."""
    import json

    from kai_fractions.contract import MAX_PIPE_DIRECTORY, MPS_SERVER
    from kai_fractions.node.config import _NAMESPACE_LEN, NodeConfig
    from kai_fractions.node.errors import ConfigError

    longest = MAX_PIPE_DIRECTORY - len(f"/{MPS_SERVER}/") - _NAMESPACE_LEN
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["hostPaths"]["properties"]["mpsPipeDir"]["maxLength"] == longest
    fits = "/var/lib/kai-fractions/" + "m" * (longest - len("/var/lib/kai-fractions/"))
    NodeConfig(node_name="n", mps_pipe_dir=fits)  # the agent takes it, and no more
    with pytest.raises(ConfigError, match=r"--mps-pipe-dir: .* is too long"):
        NodeConfig(node_name="n", mps_pipe_dir=fits + "x")
    render(sets=(f"hostPaths.mpsPipeDir={fits}",))
    assert "/hostPaths/mpsPipeDir" in template_error(f"hostPaths.mpsPipeDir={fits}x")


def test_listen_host_reaches_every_listener_and_each_server_takes_it():
    """IPv6-only clusters: `listenHost: "[::]"` makes every listener of the chart bind the v6
    wildcard (each hard-coded 0.0.0.0 before, which such a cluster's probes and API server
    cannot reach), in the form each server's own parser takes (chart review, session 22)."""
    import socket

    from prometheus_client import CollectorRegistry

    from kai_fractions.admission.server import parse_listen as admission_listen
    from kai_fractions.metrics_http import MetricsEndpoint
    from kai_fractions.metrics_http import parse_listen as metrics_listen
    from kai_fractions.mirror.grpc.security import parse_listen as grpc_listen

    docs = render(sets=("listenHost=[::]",))
    flags = {
        "mirror": container(one(docs, "Deployment", MIRROR), "mirror")["args"],
        "admission": container(one(docs, "Deployment", ADMISSION), "admission")["args"],
        "agent": container(one(docs, "DaemonSet", AGENT), "node-agent")["args"],
    }
    listens = {(who, a.split("=", 1)[0]): a.split("=", 1)[1] for who, args in flags.items()
               for a in args if a.startswith(("--listen=", "--metrics-listen="))}
    assert listens == {("mirror", "--listen"): "[::]:50051",
                       ("mirror", "--metrics-listen"): "[::]:9401",
                       ("admission", "--listen"): "[::]:8443",
                       ("admission", "--metrics-listen"): "[::]:9402",
                       ("agent", "--metrics-listen"): "[::]:9400"}
    assert grpc_listen("[::]:50051").target == "[::]:50051"
    assert admission_listen("[::]:8443") == ("::", 8443)
    assert metrics_listen("[::]:9400") == ("::", 9400)
    assert "/listenHost" in template_error("listenHost=::1")
    if socket.has_ipv6:
        endpoint = MetricsEndpoint(CollectorRegistry())
        try:
            host, port = endpoint.serve("[::]:0")
        except OSError:
            return  # a kernel without IPv6: nothing of the chart's to check here
        try:
            assert host == "::" and port > 0
        finally:
            endpoint.close()

"""The chart wires signing on by default: the Secret it creates is mounted into the mirror and
the node agent, whose `--signing-key-file` names the mounted directory; `signing.enabled=false`
removes all of it."""

from __future__ import annotations

from kai_fractions.cli import build_parser
from tests.chart.render import container, find, one, render

MIRROR = "kai-fractions-mirror"
AGENT = "kai-fractions-node-agent"
SECRET = "kai-fractions-signing"
KEY_DIR = "/etc/kai-fractions/signing"


def mirror_pod(*sets: str) -> tuple[dict, dict]:
    dep = one(render(None, sets), "Deployment", MIRROR)
    return dep["spec"]["template"]["spec"], container(dep, "mirror")


def agent_pod(*sets: str) -> tuple[dict, dict]:
    ds = one(render(None, sets), "DaemonSet", AGENT)
    return ds["spec"]["template"]["spec"], container(ds, "node-agent")


def test_the_mirror_signs_with_the_mounted_secret_by_default():
    docs = render()
    secret = one(docs, "Secret", SECRET)
    assert list(secret["data"]) == ["current"]
    pod, c = mirror_pod()
    assert f"--signing-key-file={KEY_DIR}" in c["args"]
    assert {"name": "signing-key", "mountPath": KEY_DIR, "readOnly": True} in c["volumeMounts"]
    volume = next(v for v in pod["volumes"] if v["name"] == "signing-key")
    assert volume == {"name": "signing-key",
                      "secret": {"secretName": SECRET, "defaultMode": 0o440}}
    # the mirror runs as a non-root user: the files' group (fsGroup) can read them
    assert pod["securityContext"]["fsGroup"] == 10001
    args = build_parser().parse_args(c["args"])
    assert args.signing_key_file == [KEY_DIR]


def test_by_default_the_follower_signs_with_the_key_the_agent_checks():
    """Defaults for an unmodified KAI: the one mirror process follows BindRequests AND holds the
    key, so it signs the binds it verified; it may patch pods; the admission webhook lets its
    service account write the (protected) signature key; the agent checks with the same
    Secret."""
    docs = render()
    _pod, c = mirror_pod()
    args = build_parser().parse_args(c["args"])
    assert (args.follow_bindrequests, args.signing_key_file) == (True, [KEY_DIR])
    role = one(docs, "ClusterRole", MIRROR)
    assert {"apiGroups": [""], "resources": ["pods"],
            "verbs": ["get", "list", "watch", "patch"]} in role["rules"]
    admission = one(docs, "Deployment", "kai-fractions-admission")
    hook = next(x for x in admission["spec"]["template"]["spec"]["containers"])
    assert f"--allowed-identity=system:serviceaccount:kai-fractions:{MIRROR}" in hook["args"]
    agent, a = agent_pod()
    assert f"--signing-key-file={KEY_DIR}" in a["args"]
    assert next(v for v in agent["volumes"] if v["name"] == "signing-key")["secret"][
        "secretName"] == SECRET


def test_a_secret_of_your_own():
    pod, c = mirror_pod("signing.secretName=allocation-hmac", "signing.create=false")
    volume = next(v for v in pod["volumes"] if v["name"] == "signing-key")
    assert volume["secret"]["secretName"] == "allocation-hmac"
    assert f"--signing-key-file={KEY_DIR}" in c["args"]
    assert not find(render(None, ("signing.secretName=allocation-hmac", "signing.create=false")),
                    "Secret", "allocation-hmac")


def test_signing_disabled_mounts_and_passes_nothing():
    pod, c = mirror_pod("signing.enabled=false")
    assert not any(a.startswith("--signing-key-file") for a in c["args"])
    assert all(v["name"] != "signing-key" for v in pod["volumes"])
    assert all(m["name"] != "signing-key" for m in c["volumeMounts"])


def test_the_node_agent_verifies_with_the_same_secret_by_default():
    pod, c = agent_pod()
    assert f"--signing-key-file={KEY_DIR}" in c["args"]
    assert {"name": "signing-key", "mountPath": KEY_DIR, "readOnly": True} in c["volumeMounts"]
    volume = next(v for v in pod["volumes"] if v["name"] == "signing-key")
    assert volume == {"name": "signing-key",
                      "secret": {"secretName": SECRET, "defaultMode": 0o400}}
    assert build_parser().parse_args(c["args"]).signing_key_file == [KEY_DIR]
    pod, c = agent_pod("signing.secretName=allocation-hmac", "signing.create=false")
    assert next(v for v in pod["volumes"] if v["name"] == "signing-key")["secret"][
        "secretName"] == "allocation-hmac"


def test_signing_disabled_leaves_the_node_agent_unchecked():
    pod, c = agent_pod("signing.enabled=false")
    assert not any(a.startswith("--signing-key-file") for a in c["args"])
    assert all(v["name"] != "signing-key" for v in pod["volumes"])

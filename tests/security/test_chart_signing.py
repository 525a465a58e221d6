"""The chart wires Ed25519 signing on by default: Helm generates the private key (PKCS8 PEM) into
a Secret that only the mirror mounts; the mirror publishes the public key into a ConfigMap
(`--publish-public-key`), which the node agents mount as their `--signing-key-file`. No node
mounts anything that can sign, except the old HMAC key during the one upgrade release that asks
for it (`signing.legacyHmac`). The key is kept across upgrades (`lookup`, simulated here);
`signing.enabled=false` removes all of it."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from kai_fractions.cli import build_parser
from kai_fractions.mirror.public_key import public_data
from kai_fractions.signing import V1, V2, Ed25519Key, Keyring, KeyringSource, load_keyring
from tests.chart.render import (
    HelmError,
    chart_notes,
    container,
    find,
    one,
    render,
    template_error,
)

from .allocations import KEY_A, KEY_B, plan_of, time_slicing

MIRROR = "kai-fractions-mirror"
AGENT = "kai-fractions-node-agent"
SECRET = "kai-fractions-signing-key"
LEGACY = "kai-fractions-signing"  # where the releases that signed with HMAC kept their key
PUBLIC = "kai-fractions-signing-public"
KEY_DIR = "/etc/kai-fractions/signing"
LEGACY_DIR = "/etc/kai-fractions/signing-legacy-hmac"
NODE = "gpu-node-1"


def mirror_pod(*sets: str, values_file: Path | None = None) -> tuple[dict, dict]:
    dep = one(render(values_file, sets), "Deployment", MIRROR)
    return dep["spec"]["template"]["spec"], container(dep, "mirror")


def agent_pod(*sets: str, values_file: Path | None = None) -> tuple[dict, dict]:
    ds = one(render(values_file, sets), "DaemonSet", AGENT)
    return ds["spec"]["template"]["spec"], container(ds, "node-agent")


def secret_files(docs: list[dict], name: str) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in one(docs, "Secret", name)["data"].items()}


def write_dir(folder: Path, files: dict[str, bytes | str]) -> str:
    folder.mkdir(parents=True)
    for name, content in files.items():
        (folder / name).write_bytes(content.encode() if isinstance(content, str) else content)
    return str(folder)


def lookup_values(tmp_path: Path, signing: dict[str, bytes] | None = None,
                  legacy: dict[str, bytes] | None = None, **values) -> Path:
    """A values file whose signing.simulatedLookup says what `lookup` would find (an upgrade)."""
    sim = {}
    for key, data in (("signing", signing), ("legacy", legacy)):
        if data is not None:
            sim[key] = {k: base64.b64encode(v).decode() for k, v in data.items()}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "upgrade-values.yaml"
    path.write_text(yaml.safe_dump({"signing": {"simulatedLookup": sim, **values}}))
    return path


# -- the key -------------------------------------------------------------------------------------

def test_the_generated_key_is_an_ed25519_private_key_in_pkcs8_pem(tmp_path):
    files = secret_files(render(), SECRET)
    assert list(files) == ["current"]
    pem = files["current"]
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS8, what the mirror loads
    key = serialization.load_pem_private_key(pem, password=None)
    assert isinstance(key, ed25519.Ed25519PrivateKey)
    (loaded,) = load_keyring([write_dir(tmp_path / "signing", files)]).keys
    assert loaded.version == V2 and loaded.can_sign


def test_the_mirror_signs_and_the_agent_verifies_with_only_the_published_public_key(tmp_path):
    """End to end over the rendered key: the mirror's mount (the Secret's files) signs; what
    `--publish-public-key` writes into the ConfigMap, mounted as the agent's key directory,
    verifies; and the agent's keyring cannot sign."""
    docs = render()
    mirror_dir = write_dir(tmp_path / "mirror", secret_files(docs, SECRET))
    mirror = KeyringSource([mirror_dir])
    configmap = public_data(mirror)
    assert list(configmap) == ["current"]
    assert configmap["current"].startswith("-----BEGIN PUBLIC KEY-----")
    agent = load_keyring([write_dir(tmp_path / "agent", configmap)])
    assert not any(key.can_sign for key in agent.keys)
    plan = plan_of(time_slicing())
    signature = mirror.current().sign(plan, NODE)
    assert signature.startswith("v2;")
    assert agent.verify(plan, signature, node=NODE).ok
    assert not agent.verify(plan, signature, node="gpu-node-2").ok  # bound to its node


# -- where it is mounted -------------------------------------------------------------------------

def test_only_the_mirror_mounts_the_private_key_and_it_publishes_the_public_key():
    pod, c = mirror_pod()
    assert f"--signing-key-file={KEY_DIR}" in c["args"]
    assert f"--publish-public-key=kai-fractions/{PUBLIC}" in c["args"]
    assert {"name": "signing-key", "mountPath": KEY_DIR, "readOnly": True} in c["volumeMounts"]
    volume = next(v for v in pod["volumes"] if v["name"] == "signing-key")
    assert volume == {"name": "signing-key",
                      "secret": {"secretName": SECRET, "defaultMode": 0o440}}
    # the mirror runs as a non-root user: the files' group (fsGroup) can read them
    assert pod["securityContext"]["fsGroup"] == 10001
    args = build_parser().parse_args(c["args"])
    assert (args.signing_key_file, args.publish_public_key) == (
        [KEY_DIR], f"kai-fractions/{PUBLIC}")


LEGACY_PROVIDED = ("signing.legacyHmac.enabled=true", "signing.legacyHmac.create=false")


@pytest.mark.parametrize("sets", [(), LEGACY_PROVIDED], ids=["default", "legacy"])
def test_no_node_agent_volume_holds_the_private_key(sets):
    """The kubelet may read every Secret a pod on its node mounts: the agent DaemonSet names
    neither the signing Secret nor any Secret the mirror mounts."""
    docs = render(None, sets)
    pod, c = agent_pod(*sets)
    secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert SECRET not in secrets
    mirror = one(docs, "Deployment", MIRROR)["spec"]["template"]["spec"]
    assert not secrets & {v["secret"]["secretName"] for v in mirror["volumes"] if "secret" in v}
    volume = next(v for v in pod["volumes"] if v["name"] == "signing-public-key")
    assert volume == {"name": "signing-public-key",
                      "configMap": {"name": PUBLIC, "defaultMode": 0o444}}
    assert {"name": "signing-public-key", "mountPath": KEY_DIR, "readOnly": True} in c[
        "volumeMounts"]
    assert c["args"].count(f"--signing-key-file={KEY_DIR}") == 1


def test_the_agent_verifies_with_the_published_configmap_by_default():
    pod, c = agent_pod()
    assert [a for a in c["args"] if a.startswith("--signing-key-file")] == [
        f"--signing-key-file={KEY_DIR}"]
    assert build_parser().parse_args(c["args"]).signing_key_file == [KEY_DIR]
    assert {v["name"] for v in pod["volumes"]} >= {"signing-public-key"}
    assert "signing-legacy-hmac" not in {v["name"] for v in pod["volumes"]}
    pod, c = agent_pod("signing.publicKeyConfigMap=allocation-public")
    assert next(v for v in pod["volumes"] if v["name"] == "signing-public-key")["configMap"][
        "name"] == "allocation-public"
    _pod, m = mirror_pod("signing.publicKeyConfigMap=allocation-public")
    assert "--publish-public-key=kai-fractions/allocation-public" in m["args"]


def test_by_default_the_follower_signs_with_the_key_whose_public_half_the_agent_checks():
    """Defaults for an unmodified KAI: the one mirror process follows BindRequests AND holds the
    key, so it signs the binds it verified; it may patch pods; the admission webhook lets its
    service account write the (protected) signature key; the agent checks with the public key
    the same mirror publishes."""
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
    assert next(v for v in agent["volumes"] if v["name"] == "signing-public-key")[
        "configMap"]["name"] == args.publish_public_key.split("/")[1]


def test_the_mirror_may_publish_exactly_its_configmap():
    docs = render()
    role = one(docs, "Role", f"{MIRROR}-signing-key")
    assert role["metadata"]["namespace"] == "kai-fractions"
    # no get on the key's Secret (mounted): a leaked token of the mirror cannot fetch the
    # private key. The public keys' ConfigMap is read by name, to publish it again when it was
    # deleted or edited.
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [PUBLIC],
         "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]}]
    binding = one(docs, "RoleBinding", f"{MIRROR}-signing-key")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": MIRROR,
                                    "namespace": "kai-fractions"}]
    # nobody else touches configmaps or secrets
    for r in (d for d in docs if d["kind"] in ("Role", "ClusterRole")
              and d["metadata"]["name"] != f"{MIRROR}-signing-key"):
        for rule in r["rules"]:
            assert not {"configmaps", "secrets"} & set(rule["resources"]), r["metadata"]["name"]


def test_a_secret_of_your_own():
    sets = ("signing.secretName=allocation-key", "signing.create=false")
    pod, c = mirror_pod(*sets)
    volume = next(v for v in pod["volumes"] if v["name"] == "signing-key")
    assert volume["secret"]["secretName"] == "allocation-key"
    assert f"--signing-key-file={KEY_DIR}" in c["args"]
    assert not find(render(None, sets), "Secret", "allocation-key")


def test_signing_disabled_mounts_and_passes_nothing():
    docs = render(None, ("signing.enabled=false",))
    assert not find(docs, "Secret", SECRET)
    for pod, c in (mirror_pod("signing.enabled=false"), agent_pod("signing.enabled=false")):
        assert not any(a.startswith(("--signing-key-file", "--publish-public-key"))
                       for a in c["args"])
        assert not {v["name"] for v in pod["volumes"]} & {
            "signing-key", "signing-public-key", "signing-legacy-hmac"}
    assert not find(docs, "Role", f"{MIRROR}-signing-key")


# -- upgrades: the key is kept; an HMAC key is replaced, and kept for one release on demand -----

def test_an_upgrade_keeps_the_ed25519_keys_the_secret_holds(tmp_path):
    current, previous = Ed25519Key.generate().private_pem(), Ed25519Key.generate().private_pem()
    values = lookup_values(tmp_path, signing={"current": current, "previous": previous})
    files = secret_files(render(values), SECRET)
    assert files == {"current": current, "previous": previous}  # a rotation in progress too


def test_an_upgrade_from_hmac_gets_an_ed25519_key_in_a_new_secret(tmp_path):
    """The HMAC releases' Secret is never overwritten with the private key: their agents mount
    it, and keep it until the rollout replaces them."""
    values = lookup_values(tmp_path, legacy={"current": KEY_A, "previous": KEY_B})
    docs = render(values)
    files = secret_files(docs, SECRET)
    assert list(files) == ["current"]
    assert isinstance(serialization.load_pem_private_key(files["current"], password=None),
                      ed25519.Ed25519PrivateKey)
    assert not find(docs, "Secret", LEGACY)  # legacyHmac is off by default: Helm deletes it


def test_a_signing_secret_holding_an_hmac_key_gets_an_ed25519_one(tmp_path):
    values = lookup_values(tmp_path, signing={"current": KEY_A, "previous": KEY_B})
    files = secret_files(render(values), SECRET)
    assert list(files) == ["current"]
    assert files["current"].startswith(b"-----BEGIN PRIVATE KEY-----")


def test_the_private_key_never_goes_into_the_secret_the_agents_mount():
    err = template_error(f"signing.secretName={LEGACY}")
    assert (f"signing.secretName and signing.legacyHmac.secretName are both {LEGACY}: the "
            "private key must not go into the Secret the node agents mount") in err


def test_the_upgrade_release_keeps_the_hmac_key_for_the_agents_only(tmp_path):
    values = lookup_values(tmp_path, legacy={"current": KEY_A, "previous": KEY_B},
                           legacyHmac={"enabled": True})
    docs = render(values)
    assert list(secret_files(docs, SECRET)) == ["current"]  # the mirror: Ed25519 only
    assert secret_files(docs, LEGACY) == {"current": KEY_A, "previous": KEY_B}
    pod, c = agent_pod(values_file=values)
    assert [a for a in c["args"] if a.startswith("--signing-")] == [
        f"--signing-key-file={KEY_DIR}", f"--signing-hmac-key-file={LEGACY_DIR}"]
    assert next(v for v in pod["volumes"] if v["name"] == "signing-legacy-hmac") == {
        "name": "signing-legacy-hmac", "secret": {"secretName": LEGACY, "defaultMode": 0o400}}
    assert {"name": "signing-legacy-hmac", "mountPath": LEGACY_DIR, "readOnly": True} in c[
        "volumeMounts"]
    mirror, m = mirror_pod(values_file=values)
    assert LEGACY not in {v.get("secret", {}).get("secretName") for v in mirror["volumes"]}
    assert not any(LEGACY_DIR in a for a in m["args"])
    # the agent's keyring: the published public key and the old HMAC keys; a pod signed before
    # the upgrade verifies, and new signatures are Ed25519 (the mirror holds no HMAC key)
    mirror_dir = write_dir(tmp_path / "mirror", secret_files(docs, SECRET))
    mirror_keys = KeyringSource([mirror_dir])
    agent = load_keyring([write_dir(tmp_path / "public", public_data(mirror_keys))],
                         verify_only=True,
                         hmac_paths=[write_dir(tmp_path / "legacy", secret_files(docs, LEGACY))])
    assert [key.version for key in agent.keys] == [V2, V1, V1]
    plan = plan_of(time_slicing())
    old_signature = Keyring.of(KEY_A).sign(plan)
    assert agent.verify(plan, old_signature, node=NODE).ok
    assert mirror_keys.current().sign(plan, NODE).startswith("v2;")


def test_later_upgrades_keep_the_legacy_secret_until_it_is_disabled(tmp_path):
    key = Ed25519Key.generate().private_pem()
    values = lookup_values(tmp_path, signing={"current": key}, legacy={"current": KEY_A},
                           legacyHmac={"enabled": True})
    docs = render(values)
    assert secret_files(docs, LEGACY) == {"current": KEY_A}
    assert secret_files(docs, SECRET) == {"current": key}
    # an HMAC key the signing Secret still held (a hand-made setup) is kept for the agents too
    values = lookup_values(tmp_path / "b", signing={"current": KEY_B},
                           legacyHmac={"enabled": True})
    assert secret_files(render(values), LEGACY) == {"current": KEY_B}


def test_legacy_hmac_without_an_hmac_key_is_refused_with_the_reason():
    err = template_error("signing.legacyHmac.enabled=true")
    assert "signing.legacyHmac.enabled: there is no HMAC key to keep" in err
    assert (f"neither Secret kai-fractions/{LEGACY} nor Secret kai-fractions/{SECRET} holds "
            "one") in err
    # a Secret you provide is mounted as it is
    docs = render(None, ("signing.legacyHmac.enabled=true", "signing.legacyHmac.create=false"))
    assert not find(docs, "Secret", LEGACY)


def test_schema_checks_the_signing_values():
    err = template_error("signing.publicKeyConfigMap=Not_A_Name",
                         "signing.legacyHmac.enable=true")
    assert "/signing/publicKeyConfigMap" in err
    assert "additional properties 'enable' not allowed" in err
    with pytest.raises(HelmError, match="/signing/simulatedLookup/signing/current"):
        render(None, ("signing.simulatedLookup.signing.current=not base64!",))


def test_notes_say_the_agents_wait_for_the_public_key_and_when_hmac_is_still_held():
    text = chart_notes()
    assert f"Node agents start once the mirror has published the signing public key into\n" \
           f"   ConfigMap {PUBLIC}" in text
    assert "legacyHmac" not in text
    text = chart_notes(*LEGACY_PROVIDED)
    assert f"node agents also verify with the old HMAC key ({LEGACY})" in text
    assert "Set it to false in the next upgrade" in text

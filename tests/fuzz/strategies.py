"""Hypothesis strategies shared by the fuzz tests: contract-shaped annotations (real keys with
plausible and hostile values), arbitrary JSON shapes, and the Go quoting of a downward-API file.
Settings: a fixed seed (derandomize) and no example database, so CI runs the same examples."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from kai_fractions.contract import DEFAULT_KEYS
from kai_fractions.contract import keys as k

FUZZ = settings(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

GPU_A = "GPU-1111aaaa-0000-4000-8000-000000000001"
GPU_B = "GPU-2222bbbb-0000-4000-8000-000000000002"
CONTAINERS = ("main", "side", "trainer")

container_names = st.one_of(st.sampled_from(CONTAINERS),
                            st.from_regex(r"[a-z0-9]([-a-z0-9]{0,8}[a-z0-9])?", fullmatch=True),
                            st.text(max_size=12))

_PLAUSIBLE = (
    "0", "1", "-1", "0.5", "0.25", "1.0", "1.5", ".5", "5e-1", "1e3", "0.00001", "0.000001",
    "20Gi", "20480Mi", "1024", "500m", "1.5Gi", "-1Gi", "0Mi", "1e20", "9" * 40, "Inf", "NaN",
    "0x10", "1_000", " 1", "1 ", "", " ", "sm-sharing", "time-slicing", "SM-SHARING", "mps",
    GPU_A, f"{GPU_A},{GPU_B}", f"{GPU_A},", f",{GPU_A}", f"{GPU_A},{GPU_A}",
    f"k8s.device-plugin.nvidia.com/gpu={GPU_A}", "MIG-1234", "GPU-zz", "Fraction", "Regular",
    "2", "3", "true", "v1;kid=00000000;sig=" + "A" * 43,
)
values = st.one_of(st.sampled_from(_PLAUSIBLE), st.text(max_size=24),
                   st.decimals(allow_nan=False, allow_infinity=False).map(str),
                   st.integers(min_value=-2**70, max_value=2**70).map(str))


def _contract_key(container: str, suffix: str) -> str:
    return DEFAULT_KEYS.container(container, suffix)


_POD_KEYS = (*k.LEGACY_POD_KEYS, k.RECEIVED_RESOURCE_TYPE, k.LEGACY_COMPUTE_MODE,
             k.MIRRORED_RECORD)
_DERIVED = (k.DERIVED_MEMORY_REQUEST_MIB, k.DERIVED_MEMORY_LIMIT_MIB, k.DERIVED_PINNED_MEM_LIMIT,
            k.DERIVED_ACTIVE_THREAD_PERCENTAGE, k.DERIVED_PIPE_DIRECTORY, k.DERIVED_PLAN_DIGEST,
            k.DERIVED_SIGNATURE)

annotation_keys = st.one_of(
    st.builds(_contract_key, container_names, st.sampled_from(k.SUFFIXES)),
    st.builds(DEFAULT_KEYS.derived, container_names, st.sampled_from(_DERIVED)),
    st.builds(DEFAULT_KEYS.portion_limit, container_names),
    st.sampled_from(_POD_KEYS),
    st.text(max_size=30),
)
annotations = st.dictionaries(annotation_keys, values, max_size=10)

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                         st.text(max_size=12))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=20)


def container_spec(name: str, gpus) -> dict:
    spec: dict = {"name": name, "image": "registry.invalid/app:1"}
    if gpus is not None:
        spec["resources"] = {"limits": {k.WHOLE_GPU_RESOURCE: gpus}}
    return spec


containers = st.lists(st.builds(container_spec, container_names,
                                st.one_of(st.none(), st.integers(-1, 3), st.text(max_size=3))),
                      min_size=0, max_size=3)


def pod_object(anns: dict, cs: list, uid: str = "0b7e1c9a-3d2f-4a5b-8c6d-7e8f9a0b1c2d") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "fuzz", "namespace": "team-a", "uid": uid,
                         "annotations": anns},
            "spec": {"containers": cs}}


pods = st.builds(pod_object, annotations, containers)

_SIMPLE = {0x07: "\\a", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t",
           0x0B: "\\v", 0x5C: "\\\\", 0x22: '\\"'}


def go_quote(value: str) -> str:
    """Go's strconv.Quote, as the kubelet writes a downward-API value."""
    out = ['"']
    for ch in value:
        code = ord(ch)
        if code in _SIMPLE:
            out.append(_SIMPLE[code])
        elif ch.isprintable():
            out.append(ch)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


qualified_names = st.from_regex(r"([a-z0-9.-]{1,20}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,20}"
                                r"[A-Za-z0-9])?", fullmatch=True)
annotation_values = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)

"""Every parser, fed at random: it returns a value or raises its own documented error, never
anything else; and what the project writes, it reads back unchanged."""

from __future__ import annotations

import json
from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

from kai_fractions.contract import (
    DEFAULT_KEYS,
    ContractViolation,
    ManifestError,
    derived_annotations,
    format_plain,
    parse_decimal,
    parse_pod,
    plan_pod,
    pod_views,
    view_from_pod_spec,
)
from kai_fractions.contract.errors import ContractError
from kai_fractions.gate.check import Outcome, Verdict, judge
from kai_fractions.gate.downward import DownwardError, parse_annotations
from kai_fractions.marker import (
    ContainerMarker,
    Marker,
    MarkerError,
    MarkerState,
    parse_marker,
)
from kai_fractions.mirror.record import MirrorRecord, decode_record
from kai_fractions.node.procfs import cgroup_v2_path, parse_cgroup_path
from kai_fractions.signing import (
    Keyring,
    Signature,
    SignatureFormatError,
    allocation_claims,
    parse_signature,
)

from .strategies import (
    FUZZ,
    annotation_values,
    annotations,
    go_quote,
    json_values,
    pods,
    qualified_names,
)

KEYRING = Keyring.of(bytes(range(32)))


# -- numbers ---------------------------------------------------------------------------------
# That quantities and decimals parse or say why, and parse exactly, is property-tested with the
# contract (tests/contract/test_properties.py); what stays here is the exact round trip.


@FUZZ
@given(st.integers(0, 10**12), st.integers(0, 12), st.integers(0, 12))
def test_plain_decimals_round_trip(numerator, twos, fives):
    value = Fraction(numerator, 2**twos * 5**fives)  # every finite decimal has this form
    assert parse_decimal(format_plain(value)) == value


# -- annotations (the contract) ----------------------------------------------------------------

@FUZZ
@given(pods)
def test_any_annotations_parse_into_errors_never_exceptions(obj):
    try:
        view = view_from_pod_spec(obj["metadata"], obj["spec"])
    except ManifestError as e:
        assert str(e)
        return
    request = parse_pod(view)
    for error in (*request.errors, *request.warnings):
        assert isinstance(error, ContractError) and str(error)
    try:
        plans = plan_pod(request)
    except ContractViolation as e:
        assert e.errors and all(str(x) for x in e.errors)
        return
    for plan in plans:
        assert plan.env and plan.digest.startswith("sha256:")
        derived_annotations(plan)
        allocation_claims(plan)
        assert KEYRING.verify(plan, KEYRING.sign(plan)).ok


@FUZZ
@given(json_values)
def test_any_manifest_shape_is_a_view_or_a_manifest_error(obj):
    try:
        views = list(pod_views(obj)) if isinstance(obj, dict) else []
    except ManifestError as e:
        assert str(e)
        return
    for view in views:
        parse_pod(view)


@FUZZ
@given(st.dictionaries(st.sampled_from(["metadata", "spec"]), json_values, max_size=2))
def test_any_metadata_and_spec_shape(obj):
    try:
        view = view_from_pod_spec(obj.get("metadata"), obj.get("spec"))
    except ManifestError as e:
        assert str(e)
        return
    parse_pod(view)


# -- the downward-API file (the gate) ------------------------------------------------------------

@FUZZ
@given(st.text(max_size=200))
def test_downward_files_parse_or_name_the_line(text):
    try:
        out = parse_annotations(text)
    except DownwardError as e:
        assert str(e).startswith("line ")
    else:
        assert all(isinstance(key, str) and isinstance(v, str) for key, v in out.items())


@FUZZ
@given(st.dictionaries(qualified_names, annotation_values, max_size=8))
def test_downward_files_as_the_kubelet_writes_them_round_trip(mapping):
    text = "\n".join(f"{key}={go_quote(value)}" for key, value in sorted(mapping.items()))
    assert parse_annotations(text) == mapping


@FUZZ
@given(annotations, st.one_of(st.none(), st.text(max_size=200)),
       st.lists(st.sampled_from(["main", "side", "trainer"]), max_size=3))
def test_the_gate_judges_anything_without_raising(anns, marker_text, containers):
    marker = None
    if marker_text is not None:
        try:
            marker = parse_marker(marker_text)
        except MarkerError:
            marker = None
    verdict = judge(anns, marker, pod_uid="0b7e1c9a-3d2f-4a5b-8c6d-7e8f9a0b1c2d",
                    keys=DEFAULT_KEYS, boot_id="0b0a1c2d-3e4f-4a5b-8c6d-7e8f9a0b1c2d",
                    containers=containers)
    assert isinstance(verdict, Verdict) and isinstance(verdict.outcome, Outcome)
    assert verdict.message and "\n" not in verdict.message


# -- the marker ----------------------------------------------------------------------------------

@FUZZ
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200),
                 json_values.map(json.dumps)))
def test_markers_parse_or_name_the_field(data):
    try:
        marker = parse_marker(data)
    except MarkerError as e:
        assert str(e)
    else:
        assert isinstance(marker, Marker)


_DIGEST = st.binary(min_size=32, max_size=32).map(lambda b: "sha256:" + b.hex())
_REASON = st.builds(lambda head, tail: head + tail, st.sampled_from("ARSX"),
                    st.text("abcXYZ019", max_size=12))
container_markers = st.one_of(
    st.builds(ContainerMarker.applied, _DIGEST, st.text(max_size=30)),
    st.builds(ContainerMarker.refused, _REASON, st.text(min_size=1, max_size=30),
              st.one_of(st.just(""), _DIGEST)),
)


@FUZZ
@given(st.uuids().map(str),
       st.dictionaries(st.text("abc-z09", min_size=1, max_size=10), container_markers,
                       max_size=3),
       st.integers(0, 2**33), st.uuids().map(str))
def test_markers_round_trip(uid, containers, when, boot_id):
    marker = Marker.build(uid, containers, boot_id=boot_id, clock=lambda: when)
    again = parse_marker(marker.to_json(), expected_pod_uid=uid)
    assert again.to_dict() == marker.to_dict()
    assert all(c.state in (MarkerState.APPLIED, MarkerState.REFUSED)
               for c in again.containers.values())


# -- signatures --------------------------------------------------------------------------------

@FUZZ
@given(st.one_of(st.text(max_size=160), st.builds(
    lambda kid, sig: f"v1;kid={kid};sig={sig}", st.text(max_size=10), st.text(max_size=50))))
def test_signatures_parse_or_say_why(value):
    try:
        signature = parse_signature(value)
    except SignatureFormatError as e:
        assert str(e)
    else:
        assert signature.encode() == value


@FUZZ
@given(st.from_regex(r"[0-9a-f]{8}", fullmatch=True), st.binary(min_size=32, max_size=32))
def test_signatures_round_trip(kid, mac):
    value = Signature(kid, mac).encode()
    assert parse_signature(value) == Signature(kid, mac)


@FUZZ
@given(pods, st.one_of(st.none(), st.text(max_size=120)))
def test_verification_never_raises(obj, value):
    try:
        plans = plan_pod(parse_pod(view_from_pod_spec(obj["metadata"], obj["spec"])))
    except (ManifestError, ContractViolation):
        return
    for plan in plans:
        verdict = KEYRING.verify(plan, value)
        assert verdict.ok is False or value == KEYRING.sign(plan)
        assert verdict.ok or verdict.reason in ("SignatureMissing", "SignatureInvalid")


# -- the mirror's record, /proc cgroup lines -----------------------------------------------------

@FUZZ
@given(st.one_of(st.none(), st.text(max_size=120), json_values.map(json.dumps)))
def test_mirror_records_decode_or_are_ignored(value):
    record = decode_record(value)
    assert record is None or isinstance(record, MirrorRecord)


@FUZZ
@given(st.text(max_size=200))
def test_proc_cgroup_files_never_raise(text):
    path = cgroup_v2_path(text)
    if path is not None:
        parse_cgroup_path(path)
    parse_cgroup_path(text)

"""Edits of a Node's metadata sent through `nodes/status`, which the node-status policies (the
mirror's and the uninstall hook's) refuse: the API server resets only the spec there, so labels,
annotations, owner references and finalizers would be written. Each edit with the words its
refusal must carry."""

from __future__ import annotations

METADATA_EDITS = (
    (lambda n: n["metadata"]["labels"].update({"kai.scheduler/node-pool": "x"}),
     "may not change a Node's labels (metadata.labels)"),
    (lambda n: n["metadata"]["labels"].pop("nvidia.com/gpu.present"),
     "may not change a Node's labels (metadata.labels)"),
    (lambda n: n["metadata"]["annotations"].update({"a": "b"}),
     "may not change a Node's annotations (metadata.annotations)"),
    (lambda n: n["metadata"].update(ownerReferences=[{
        "apiVersion": "v1", "kind": "ConfigMap", "name": "gone", "uid": "00000000-dead"}]),
     "may not change a Node's owner references (metadata.ownerReferences"),
    (lambda n: n["metadata"].update(finalizers=["example.com/block"]),
     "may not change a Node's finalizers (metadata.finalizers)"),
)
METADATA_EDIT_IDS = ("label added", "label removed", "annotation", "ownerReferences",
                     "finalizers")

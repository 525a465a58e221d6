"""webhook.objectSelector narrows the mutating webhook only; the validating pod webhook has none
and refuses a pod with NvFractions keys that the selector left unwired. Before, values.yaml
suggested narrowing it to pods with kai.scheduler/queue, and the install said nothing: but KAI
reads the queue label from the pod's top owner first (upstream podgrouper, CalcPodGroupQueue),
and KAI's own RayCluster and MPIJob examples label only that object, so their fractional pods
would be refused. Now NOTES.txt warns whenever a selector is set."""

from __future__ import annotations

import yaml

from .render import chart_notes

WARNING = "WARNING: webhook.objectSelector is set"


def test_notes_warn_when_an_object_selector_narrows_the_mutating_webhook(tmp_path) -> None:
    """Before: no word of it. Now: the warning says that an unmatched fractional pod is refused,
    why a queue label is such a selector, and what to use instead."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"webhook": {"objectSelector": {"matchExpressions": [
        {"key": "kai.scheduler/queue", "operator": "Exists"}]}}}))
    notes = chart_notes(values_file=values)
    assert WARNING in notes, notes
    text = " ".join(notes.split(WARNING, 1)[1].split("\n\n", 1)[0].split())
    for phrase in ("refuses", "kai.scheduler/queue", "top owner", "webhook.namespaceSelector"):
        assert phrase in text, (phrase, text)
    assert WARNING not in chart_notes()  # the default, {}: every pod is wired

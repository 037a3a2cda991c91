"""Reading Prometheus text (what ``/metrics`` serves) in tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metric_total(text: str, name: str, **labels) -> float:
    """The sum of the samples of ``text`` named ``name`` whose labels include ``labels``."""
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

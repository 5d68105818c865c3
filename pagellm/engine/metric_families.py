"""One logical metric under pagellm's names, vLLM's, or both (``--metrics-prefix``).

vLLM's series (``vllm:num_requests_running``, ...) carry its labels (``model_name`` and ``engine``)
and its histogram buckets, so that what reads vLLM's ``/metrics`` (its Grafana dashboard, KEDA
scalers, the Gateway API inference extension's endpoint picker) reads this server's unchanged.
pagellm's own series (``pagellm_...``) keep their names, labels and buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

METRICS_PREFIXES = ("vllm", "pagellm", "both")
VLLM_ENGINE = "0"  # vLLM's `engine` label: the index of its one engine core here

# vLLM's buckets (vllm/v1/metrics/loggers.py).
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                              10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets, up to max_model_len)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Series:
    """One labelled child per prefix; each update goes to all of them."""

    def __init__(self, children: Sequence[Any]) -> None:
        self.children = tuple(children)

    def inc(self, amount: float = 1.0) -> None:
        for c in self.children:
            c.inc(amount)

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class Family:
    """A metric's collectors, one per exposed name, with each one's fixed label values."""

    def __init__(self, collectors: Sequence[tuple[Any, dict[str, str]]]) -> None:
        self.collectors = tuple(collectors)
        self._children: dict[tuple[tuple[str, str], ...], Series] = {}

    def labels(self, **extra: str) -> Series:
        key = tuple(sorted(extra.items()))
        series = self._children.get(key)
        if series is None:
            series = self._children[key] = Series([c.labels(**fixed, **extra) for c, fixed in self.collectors])
        return series


class MetricFactory:
    """Builds ``Family``s in one registry, under the names ``prefix`` asks for."""

    def __init__(self, registry: CollectorRegistry, model_name: str, prefix: str = "both") -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"--metrics-prefix must be one of {', '.join(METRICS_PREFIXES)}, got {prefix!r}")
        self.registry = registry
        self.model_name = model_name
        self.pagellm = prefix in ("pagellm", "both")
        self.vllm = prefix in ("vllm", "both")

    def _make(self, cls: type, name: str, doc: str, extra: Sequence[str], vllm: str | Sequence[str] | None,
              buckets: Sequence[float] | None, vllm_buckets: Sequence[float] | None) -> Family:
        """``name``: pagellm's; ``vllm``: vLLM's (its part after ``vllm:``) or several, None where vLLM has none."""
        collectors: list[tuple[Any, dict[str, str]]] = []

        def build(full: str, labels: list[str], bounds: Sequence[float] | None) -> Any:
            kwargs: dict[str, Any] = {"registry": self.registry}
            if cls is Histogram:
                kwargs["buckets"] = bounds
            return cls(full, doc, labels, **kwargs)

        if self.pagellm:
            collectors.append((build(name, ["model_name", *extra], buckets),
                               {"model_name": self.model_name}))
        if self.vllm and vllm is not None:
            for vname in [vllm] if isinstance(vllm, str) else vllm:
                collectors.append((build(f"vllm:{vname}", ["model_name", "engine", *extra], vllm_buckets or buckets),
                                   {"model_name": self.model_name, "engine": VLLM_ENGINE}))
        return Family(collectors)

    def gauge(self, name: str, doc: str, vllm: str | Sequence[str] | None = None) -> Family:
        return self._make(Gauge, name, doc, (), vllm, None, None)

    def counter(self, name: str, doc: str, extra: Sequence[str] = (), vllm: str | None = None) -> Family:
        return self._make(Counter, name, doc, extra, vllm, None, None)

    def histogram(self, name: str, doc: str, buckets: Sequence[float], vllm: str | Sequence[str] | None = None,
                  vllm_buckets: Sequence[float] | None = None) -> Family:
        return self._make(Histogram, name, doc, (), vllm, buckets, vllm_buckets)

"""Prometheus metrics of `specdec serve` (GET /metrics), in a registry of their own per server.

Per request, as the client sees it: time to first token (arrival to the first streamed token),
time per output token (first to last token over the tokens after the first), prompt and generated
token counters (tokens/s is `rate(specdec_generated_tokens_total[1m])`). Read from the engine
at each scrape: requests by finish reason (the engine's own count, so a request a client drops
while its last step finishes it counts once; "error" = a fault ended it), queue length, running
rows, and the acceptance rate and tau (tokens per target forward, bonus token included) of
everything decoded so far, also per drafter (the member of a composite or hybrid that made
each verified proposal: which drafter pays on this traffic), and the KV cache: positions in use,
prompt tokens prefilled or served by the prefix cache, its blocks and evictions. Error replies by code: refused
(4xx) and failed (5xx, or a stream's error event).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


FINISH_REASONS = ("stop", "length", "cancelled", "error")


class _Requests(Collector):
    """specdec_requests_total{finish_reason}: the engine's counts of finished requests."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        family = CounterMetricFamily("specdec_requests", "Finished requests", labels=["finish_reason"])
        counts = self.engine.metrics
        for reason in FINISH_REASONS:
            family.add_metric([reason], counts.get(f"finished_{reason}", 0))
        yield family


class _ByDrafter(Collector):
    """specdec_drafter_{steps,drafted_tokens,accepted_tokens}_total{drafter} and
    specdec_drafter_{acceptance_rate,tau}{drafter}: the steps whose proposal each drafter made (a
    composite's or hybrid's member), read from the engine."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        by = self.engine.metrics.get("by_drafter", {})
        for key, kind, text in (("steps", "counter", "Verification steps of a row that took this drafter's proposal"),
                                ("drafted", "counter", "Draft tokens of this drafter that were verified"),
                                ("accepted", "counter", "Draft tokens of this drafter that were accepted"),
                                ("acceptance_rate", "gauge", "Accepted / drafted tokens of this drafter so far"),
                                ("tau", "gauge", "Tokens per target forward on the steps of this drafter")):
            name = f"specdec_drafter_{key}" + ("_tokens" if key in ("drafted", "accepted") else "")
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, labels=["drafter"])
            for drafter, figures in by.items():
                family.add_metric([drafter], figures[key])
            yield family


class _KVCache(Collector):
    """The KV cache, read from the engine: positions held by running rows and the rows' capacity
    (a paged cache's blocks in use and free);
    prompt tokens prefilled; the prefix cache's lookups, hits, prompt tokens it served (not
    prefilled), evictions, and its blocks cached and free."""

    COUNTERS = (("prefill_tokens", "specdec_prefill_tokens", "Prompt tokens run through the target"),
                ("prefix_cache_lookups", "specdec_prefix_cache_lookups", "Admissions that looked up the prefix cache"),
                ("prefix_cache_hits", "specdec_prefix_cache_hits", "Admissions that found cached blocks"),
                ("prefix_cache_hit_tokens", "specdec_prefix_cache_hit_tokens",
                 "Prompt tokens copied from the prefix cache instead of prefilled"),
                ("prefix_cache_evictions", "specdec_prefix_cache_evictions", "Cached blocks overwritten when full"),
                ("preemptions", "specdec_preemptions",
                 "Requests preempted when the paged KV cache ran out of blocks (admitted again later)"))
    GAUGES = (("kv_tokens_in_use", "specdec_kv_tokens_in_use", "KV positions held by running requests"),
              ("kv_tokens_capacity", "specdec_kv_tokens_capacity",
               "KV positions of the batch rows (of the paged cache's pool)"))

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        m = self.engine.metrics
        for key, name, text in self.COUNTERS:
            yield CounterMetricFamily(name, text, value=m[key])
        for key, name, text in self.GAUGES:
            yield GaugeMetricFamily(name, text, value=m[key])
        blocks = GaugeMetricFamily("specdec_prefix_cache_blocks", "Prefix cache blocks by state", labels=["state"])
        blocks.add_metric(["cached"], m["prefix_cache_blocks_cached"])
        blocks.add_metric(["free"], m["prefix_cache_blocks_free"])
        yield blocks
        paged = GaugeMetricFamily("specdec_kv_blocks", "Paged KV cache blocks by state: used (held by rows or the "
                                  "prefix cache), free, cached (held by the prefix cache); 0 without one",
                                  labels=["state"])
        paged.add_metric(["used"], m["kv_blocks_used"])
        paged.add_metric(["free"], m["kv_blocks_free"])
        paged.add_metric(["cached"], m["kv_blocks_cached"])
        yield paged


class ServerMetrics:
    """The server's metrics; `engine` is read at each `render()`."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "Per token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("specdec_generated_tokens", "Tokens generated", registry=r)
        r.register(_Requests(engine))
        r.register(_ByDrafter(engine))
        r.register(_KVCache(engine))
        self.rejected = Counter("specdec_rejected_requests", "Requests refused with a 4xx error", ["code"],
                                registry=r)
        self.failed = Counter("specdec_failed_requests", "Requests answered with a 5xx error or a stream's error "
                              "event", ["code"], registry=r)
        self.waiting = Gauge("specdec_queue_length", "Requests waiting for a batch row", registry=r)
        self.running = Gauge("specdec_running_rows", "Batch rows decoding now", registry=r)
        self.acceptance = Gauge("specdec_acceptance_rate", "Accepted / drafted tokens so far", registry=r)
        self.tau = Gauge("specdec_tau", "Tokens per target forward so far (bonus token included)", registry=r)

    def finished(self, ttft_s: float | None, tpot_s: float | None) -> None:
        """Record the latencies of one finished request (its tokens were counted as they came)."""
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def count_error(self, err) -> None:
        """Count an error reply (a specdec.serving.protocol.APIError): refused if 4xx, else failed."""
        counter = self.rejected if err.status < 500 else self.failed
        counter.labels(code=err.code or str(err.status)).inc()

    def render(self) -> tuple[bytes, str]:
        """(Prometheus text exposition, its content type), the engine gauges read now."""
        self.waiting.set(self.engine.waiting)
        self.running.set(self.engine.running)
        stats = self.engine.metrics
        self.acceptance.set(stats["acceptance_rate"])
        self.tau.set(stats["tau"])
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

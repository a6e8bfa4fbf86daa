"""Prometheus text of the figures of `/stats`, read at scrape time.

`GET /metrics` (the contract's route) answers ours, plus SGLang's own families when the server
runs with `--enable-metrics`: SGLang then keeps them in prometheus_client's multiprocess
directory (`PROMETHEUS_MULTIPROC_DIR`), which we read the way its own `/metrics` mount does, so
one scrape sees both. `GET /april/v1/metrics` answers ours only. Monotonic counts are counters
(`_total`), the rest gauges.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from april_server.engine.segment_state import Counters

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
COUNTERS = frozenset(Counters.__dataclass_fields__) | {"snapshots_evicted", "snapshots_rejected"}
HELP = {
    "buffered_groups": "groups waiting in the durable partial buffer",
    "running_samples": "samples generating now",
    "snapshot_bytes_used": "host bytes held by KV snapshots",
    "output_tokens": "tokens generated through the april routes",
    "recomputed_tokens": "context tokens re-prefilled by continuations",
    "restored_kv_tokens": "context tokens restored from KV snapshots",
    "engine_idle_share": "share of the last minute the engine ran no forward batch",
    "engine_idle_share_since_start": "share of the time since start-up with no forward batch",
    "awaiting_input_samples": "agent-rollout members waiting for a tool's answer",
    "stops_behind_aborts": "segments reported aborted whose last token completed a stop",
}


class _StatsCollector(Collector):
    def __init__(self, stats: dict[str, Any]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        yield InfoMetricFamily(
            "april_weight",
            "weight version now served",
            value={"version": str(s.get("weight_version"))},
        )
        yield GaugeMetricFamily(
            "april_kv_snapshots_enabled",
            "1 when KV snapshots are on",
            value=float(s.get("kv_snapshots") == "enabled"),
        )
        for key, value in s.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            doc = HELP.get(key, key.replace("_", " "))
            if key in COUNTERS:
                yield CounterMetricFamily(f"april_{key}", doc, value=value)
            else:
                yield GaugeMetricFamily(f"april_{key}", doc, value=value)
        policy = s.get("inflight_policy") or {}
        if policy.get("last_target") is not None:
            doc = "running samples the adaptive policy last aimed for"
            yield GaugeMetricFamily("april_inflight_target", doc, value=policy["last_target"])
        yield from _length_metrics(s.get("length_prediction") or {})
        clock = s.get("engine_time") or {}
        kinds = [k for k in ("prefill", "decode") if f"{k}_s" in clock]
        if kinds:
            busy = CounterMetricFamily(
                "april_engine_busy_seconds",
                "engine seconds inside forward batches, by kind",
                labels=["kind"],
            )
            tokens = CounterMetricFamily(
                "april_engine_tokens", "tokens through forward batches, by kind", labels=["kind"]
            )
            for kind in kinds:
                busy.add_metric([kind], float(clock[f"{kind}_s"]))
                tokens.add_metric([kind], float(clock[f"{kind}_tokens"]))
            yield busy
            yield tokens
        slots = s.get("running_by_slot") or []
        if len(slots) > 1:  # data parallelism: what runs where, and each rank's snapshots
            g = GaugeMetricFamily(
                "april_running_samples_by_slot",
                "samples generating now, by engine and DP rank",
                labels=["engine", "dp_rank"],
            )
            for x in slots:
                g.add_metric([str(x["engine"]), str(x["dp_rank"])], float(x["running_samples"]))
            yield g
        ranks = s.get("dp_ranks") or []
        if ranks:
            g = GaugeMetricFamily(
                "april_snapshot_bytes_used_by_rank",
                "host bytes held by KV snapshots, by DP rank",
                labels=["dp_rank"],
            )
            for r in ranks:
                g.add_metric([str(r["dp_rank"])], float(r.get("snapshot_bytes_used", 0)))
            yield g
        curve = policy.get("step_time_s_by_batch") or {}
        if curve:
            g = GaugeMetricFamily(
                "april_decode_step_seconds",
                "fitted decode step time by running batch size",
                labels=["batch"],
            )
            for batch, seconds in curve.items():
                g.add_metric([str(batch)], float(seconds))
            yield g


def _length_metrics(lp: dict[str, Any]) -> Iterator[Metric]:
    """Predicted vs actual lengths (rules/lengths.py): sums, so a rate gives the mean error
    over any window."""
    if not lp:
        return
    for name, doc, key in (
        (
            "predictions_scored",
            "finished samples whose predicted length was scored",
            "scored_samples",
        ),
        (
            "prediction_abs_error_tokens",
            "sum of |predicted - actual| final lengths, tokens",
            "abs_error_tokens",
        ),
        (
            "prediction_error_tokens",
            "sum of (predicted - actual) final lengths, tokens",
            "error_tokens",
        ),
    ):
        yield CounterMetricFamily(f"april_length_{name}", doc, value=float(lp[key]))
    doc = "prompts with a length history"
    yield GaugeMetricFamily("april_length_history_prompts", doc, value=lp["history_prompts"])


def prometheus_text(stats: dict[str, Any], with_engine: bool = False) -> bytes:
    """Our families; with `with_engine`, also those the engine's processes wrote to the
    multiprocess directory (none unless SGLang runs with `--enable-metrics`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats))
    engine_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if with_engine and engine_dir and os.path.isdir(engine_dir):
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry, path=engine_dir)  # type: ignore[no-untyped-call]
    return generate_latest(registry)

"""Output of a run: the summary table (ratios vs sync), JSONL records and PNG plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from statistics import median
from typing import Any

from .bound import bound_line
from .gap import gap_line, gap_to_bound, shares_of_generated, wall_by_cause, wall_line
from .length_stats import lengths_line
from .metrics import ModeResult
from .staleness import describe
from .staleness_ceiling import ceiling_line


def records(results: Sequence[ModeResult], run: dict[str, Any]) -> list[dict[str, Any]]:
    """One JSON object per mode: run settings, overall figures, ratios, latencies, per step."""
    sync = next((r for r in results if r.mode == "sync" and r.available and r.steps), None)
    base = sync.totals() if sync else {}
    out = []
    for r in results:
        rec: dict[str, Any] = {**run, "mode": r.mode, "available": r.available, "reason": r.reason}
        if not r.available or not r.steps:
            rec["output_throughput"] = None
            out.append(rec)
            continue
        tot = r.totals()
        rec.update(tot)
        for key in (
            "output_throughput",
            "samples_per_s",
            "generated_throughput",
            "wall_throughput",
            "steady_wall_throughput",
        ):
            b = base.get(key)
            rec[f"{key}_vs_sync"] = round(tot[key] / b, 4) if b and tot[key] else None
        bound = run.get("bound_tok_s")
        for key in (
            "output_throughput",
            "generated_throughput",
            "wall_throughput",
            "steady_wall_throughput",
        ):
            rec[f"{key}_vs_bound"] = round(tot[key] / bound, 4) if bound and tot[key] else None
        ceiling = (run.get("staleness_ceiling") or {}).get("tok_s")
        rec["output_throughput_vs_ceiling"] = (
            round(tot["output_throughput"] / ceiling, 4) if ceiling else None
        )
        rec["thrown_away_share"], rec["unconsumed_share"] = shares_of_generated(tot)
        rec["wall_by_cause"] = wall_by_cause(tot, run.get("bound_full_batch"))
        rec["gap_to_bound"] = gap_to_bound(tot, bound)
        rec.update(r.latencies.summary())
        rec["checks_ok"] = not r.checks
        rec["checks"] = r.checks
        rec["notes"] = r.notes
        rec["lengths"] = r.lengths
        rec["length_prediction"] = r.length_prediction
        rec["per_step"] = [s.to_json() for s in r.steps]
        out.append(rec)
    return out


def write_jsonl(path: Path, recs: Sequence[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for rec in recs:
            f.write(json.dumps(rec, sort_keys=False) + "\n")


def _fmt(v: Any, spec: str = ".1f") -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


COLUMNS = [  # (header, key, format)
    ("mode", "mode", ""),
    ("out tok/s", "output_throughput", ".1f"),
    ("x sync", "output_throughput_vs_sync", ".2f"),
    ("x bound", "output_throughput_vs_bound", ".2f"),
    ("wall tok/s", "wall_throughput", ".1f"),
    ("wall x sync", "wall_throughput_vs_sync", ".2f"),
    ("wall x bound", "wall_throughput_vs_bound", ".2f"),
    ("steady x bound", "steady_wall_throughput_vs_bound", ".2f"),
    ("run idle %", "run_idle_frac", "pct"),
    ("samples/s", "samples_per_s", ".2f"),
    ("gen tok/s", "generated_throughput", ".1f"),
    ("rollout s", "rollout_wall_s", ".1f"),
    ("TTQ s", "mean_time_to_quota_s", ".2f"),
    ("mean run", "mean_running", ".1f"),
    ("idle %", "idle_frac", "pct"),
    ("tail %", "tail_frac", "pct"),
    ("offpol %", "offpolicy_frac", "pct"),
    ("wasted", "tokens_wasted", ""),
    ("thrown %", "thrown_away_share", "pct"),
    ("leftover", "leftover_tokens", ""),
    ("unused %", "unconsumed_share", "pct"),
    ("recomp", "recomputed_tokens", ""),
    ("restored", "restored_kv_tokens", ""),
    ("checks", "checks_ok", ""),
]


def summary_table(recs: Sequence[dict[str, Any]]) -> str:
    rows = [[h for h, _, _ in COLUMNS]]
    notes = []
    bound = next((r for r in recs if r.get("bound_levels") is not None), None)
    for rec in recs:
        if not rec.get("available") or rec.get("output_throughput") is None:
            notes.append(f"{rec['mode']}: unavailable - {rec.get('reason')}")
            continue
        row = []
        for _, key, spec in COLUMNS:
            v = rec.get(key)
            if spec == "pct" and v is not None:
                row.append(f"{100 * v:.1f}")
            elif key == "checks_ok":
                row.append("ok" if v else "FAIL")
            else:
                row.append(_fmt(v, spec or ".1f"))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if bound is not None:
        lines.append(bound_line(bound))
        if bound.get("staleness_ceiling"):
            lines.append(ceiling_line(bound["staleness_ceiling"]))
            lines.append(ceiling_fractions_line(recs, bound["staleness_ceiling"]["max_staleness"]))
    lat = [r for r in recs if r.get("median_e2e_latency_ms") is not None]
    for r in lat:
        lines.append(
            f"{r['mode']} latency (ms, p50/p99): e2e {r['median_e2e_latency_ms']:.0f}/"
            f"{r['p99_e2e_latency_ms']:.0f}  ttft {_fmt(r['median_ttft_ms'], '.0f')}/"
            f"{_fmt(r['p99_ttft_ms'], '.0f')}  tpot {_fmt(r['median_tpot_ms'], '.1f')}/"
            f"{_fmt(r['p99_tpot_ms'], '.1f')}  itl {_fmt(r['median_itl_ms'], '.1f')}/"
            f"{_fmt(r['p99_itl_ms'], '.1f')}"
        )
    for r in recs:
        if r.get("median_group_latency_ms") is not None:
            lines.append(
                f"{r['mode']} group finish latency (ms, p50/p99): "
                f"{r['median_group_latency_ms']:.0f}/{r['p99_group_latency_ms']:.0f}"
            )
        if r.get("engine_prefill_s") is not None:
            lines.append(engine_time_line(r))
        if r.get("wall_by_cause"):
            lines.append(wall_line(r["mode"], r["rollout_wall_s"], r["wall_by_cause"]))
        if r.get("gap_to_bound"):
            lines.append(gap_line(r["mode"], r["gap_to_bound"]))
        if r.get("staleness_hist") is not None:
            lines.append(staleness_line(r))
        if any(x is not None for x in r.get("goodput_expected") or []):
            lines.append(pool_line(r, r.get("bound_tok_s")))
        if r.get("push_count") or r.get("idle_push_s") is not None:
            lines.append(push_line(r))
        if r.get("lengths"):
            lines.append(lengths_line(r["mode"], r["lengths"], r.get("length_prediction")))
        for n in r.get("notes") or []:
            lines.append(f"{r['mode']} note: {n}")
        for c in r.get("checks") or []:
            lines.append(f"CHECK FAILED {r['mode']}: {c}")
    return "\n".join(lines + notes)


def staleness_line(r: dict[str, Any]) -> str:
    hist = {int(k): v for k, v in r["staleness_hist"].items()}
    return (
        f"{r['mode']} consumed tokens by versions old (lag: tokens): {describe(hist)}; "
        f"run {r['run_wall_s']:.1f}s of which training {r['train_s']:.1f}s"
    )


def ceiling_fractions_line(recs: Sequence[dict[str, Any]], max_staleness: int) -> str:
    """Each mode's consumed tokens per second against the staleness ceiling, and the share of
    its consumed tokens older than the ceiling assumes (a mode that keeps them may pass it)."""
    parts = []
    for r in recs:
        share = r.get("output_throughput_vs_ceiling")
        if share is None:
            continue
        hist = {int(k): v for k, v in (r.get("staleness_hist") or {}).items()}
        older = sum(v for k, v in hist.items() if k > max_staleness)
        total = sum(hist.values())
        past = f" ({older / total:.0%} of its tokens older)" if total and older else ""
        parts.append(f"{r['mode']} {share:.2f}{past}")
    return "consumed x the staleness ceiling: " + ", ".join(parts)


def pool_line(r: dict[str, Any], bound_tok_s: float | None = None) -> str:
    """The server's goodput pool per call: its choice, what it expected, what it got. Its
    median expectation as a share of the bound is the ceiling the server's own play sees for
    every pool it weighs under the run's `max_staleness`."""

    def seq(key: str, spec: str = ".0f") -> str:
        return "/".join("-" if v is None else format(v, spec) for v in r.get(key) or [])

    expected = [v for v in r.get("goodput_expected") or [] if v is not None]
    of_bound = (
        f" (median {median(expected) / bound_tok_s:.2f} of the bound)"
        if expected and bound_tok_s
        else ""
    )
    return (
        f"{r['mode']} auto pool per call: running target {seq('inflight_targets', 'd')}, extra "
        f"groups {seq('extra_groups', 'd')}, advised {seq('groups_wanted', 'd')}; goodput "
        f"expected {seq('goodput_expected')}{of_bound} (sync {seq('goodput_sync')}) tok/s, got "
        f"{seq('goodput_got')}"
        + (
            ""
            if r.get("goodput_got_run") is None
            else f" ({r['goodput_got_run']:.0f} over the run)"
        )
    )


def push_line(r: dict[str, Any]) -> str:
    return (
        f"{r['mode']} weight push (s): p50 {_fmt(r.get('push_p50_s'), '.3f')}, max "
        f"{_fmt(r.get('push_max_s'), '.3f')} over {r.get('push_count', 0)} pushes; idle push "
        f"{_fmt(r.get('idle_push_s'), '.3f')}"
    )


def engine_time_line(r: dict[str, Any]) -> str:
    """Where the rollout wall time went, from the engine's own forward clock."""
    wall = r["rollout_wall_s"] or 1.0
    pre, dec, other = r["engine_prefill_s"], r["engine_decode_s"], r["engine_other_s"]
    return (
        f"{r['mode']} engine time (s): prefill {pre:.1f} ({100 * pre / wall:.0f}%, "
        f"{r['engine_prefill_tokens']} tok)  decode {dec:.1f} ({100 * dec / wall:.0f}%, "
        f"{r['engine_decode_steps']} steps, mean batch {_fmt(r['engine_mean_decode_batch'])}, "
        f"mean context {_fmt(r.get('engine_mean_decode_context'), '.0f')})  "
        f"outside forwards {other:.1f} ({100 * other / wall:.0f}%)"
    )


def plot(results: Sequence[ModeResult], plot_dir: Path, title: str) -> list[Path]:
    """running_requests.png (one panel per mode) and step_throughput.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    plot_dir.mkdir(parents=True, exist_ok=True)
    shown = [r for r in results if r.available and r.steps]
    if not shown:
        return []
    paths = []
    fig, axes = plt.subplots(
        len(shown), 1, figsize=(10, 2.6 * len(shown) + 0.6), sharey=True, squeeze=False
    )
    for ax, r in zip(axes[:, 0], shown, strict=True):
        ts = [t for t, _ in r.timeline]
        ax.step(ts, [n for _, n in r.timeline], where="post", label="running requests")
        for i, s in enumerate(r.steps):
            ax.axvspan(
                s.t_start,
                s.t_end,
                color="tab:green",
                alpha=0.08,
                label="rollout phase" if i == 0 else None,
            )
        full = r.steps[0].consumed_samples
        ax.axhline(full, color="gray", ls="--", lw=0.8, label=f"K x n = {full}")
        ax.set_title(f"{r.mode}: SGLang running batch over time")
        ax.set_ylabel("running requests")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("rollout time of this mode (s): training, updates, other modes cut out")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    paths.append(plot_dir / "running_requests.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for r in shown:
        steps = [s.step + 1 for s in r.steps]
        ax.plot(steps, [s.output_throughput for s in r.steps], marker="o", label=r.mode)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("consumed output tokens / rollout second (tok/s)")
    ax.set_title("Per-step consumed-sample throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    paths.append(plot_dir / "step_throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths

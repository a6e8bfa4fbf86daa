"""Markdown of a gpu-check report: one summary table, then one table per measurement."""

from __future__ import annotations

from typing import Any

_KV_METHODS = ("ceiling", "triton", "torch", "sglang")


def _num(value: Any, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec) if isinstance(value, float) else str(value)


def _figures(name: str, entry: dict[str, Any]) -> str:
    r = entry.get("results")
    if not r:
        return str(entry.get("command", entry.get("error", "")))[:160].replace("|", "\\|")
    if name == "environment":
        return f"{r['device']}; torch {r['torch']}, triton {r['triton']}, sglang {r['sglang']}"
    if name == "configs":
        return (
            f"{r['architecture']}: {r['layers']} layers x {r['kv_heads']} KV heads x "
            f"{r['head_dim']}, {r['kv_bytes_per_token_bf16'] // 1024} KiB KV per token, "
            f"context {r['context_len']}; server and bench flags parse"
        )
    if name == "aot":
        return (
            f"{r['launches_x_targets']} launches x targets ({', '.join(r['targets'])}), "
            f"{r['failed']} failed, at most {r['max_registers']} registers"
        )
    if name == "parity":
        tests = r.get("kernel_tests_passed")
        extra = f"; kernel tests: {tests} passed" if tests else ""
        return f"{r.get('cases')} cases, {r.get('failures')} failures{extra}"
    if name == "kv_bandwidth":
        top = max(r["rows"], key=lambda row: (row["model"] == "Llama-3.1-8B", row["tokens"]))
        return (
            f"{top['model']} {top['tokens']} tokens: triton save {_num(top['triton save'])} / "
            f"restore {_num(top['triton restore'])} GB/s; ceiling {_num(top['ceiling save'])} / "
            f"{_num(top['ceiling restore'])}"
        )
    if name == "resume":
        return "; ".join(f"{x['partial_tokens']}: x{x['speedup']:.2f}" for x in r)
    if name == "april_bench":
        return "; ".join(
            f"{x['mode']} {_num(x['output_throughput'])} tok/s"
            + (f" (x{x['output_throughput_vs_sync']:.2f})" if x["mode"] != "sync" else "")
            for x in r
            if x.get("output_throughput") is not None
        )
    return ""


def markdown(report: dict[str, Any]) -> str:
    env = report["parts"].get("environment", {}).get("results", {})
    where = "dry run, no CUDA" if report["dry_run"] else env.get("device", "CUDA")
    out = [
        f"# GPU check ({where}), {report['started_at']}, {report.get('total_s', '?')} s",
        "",
        "| part | status | s | figures |",
        "|---|---|---|---|",
    ]
    for name, entry in report["parts"].items():
        out.append(f"| {name} | {entry['status']} | {entry['seconds']} | {_figures(name, entry)} |")
    parts = report["parts"]
    out += _kv_table(parts.get("kv_bandwidth", {}))
    out += _resume_table(parts.get("resume", {}))
    out += _bench_table(parts.get("april_bench", {}))
    return "\n".join(out) + "\n"


def _kv_table(entry: dict[str, Any]) -> list[str]:
    rows = (entry.get("results") or {}).get("rows")
    if not rows:
        return []
    cols = [f"{m} {op}" for m in _KV_METHODS for op in ("save", "restore")]
    out = ["", "KV save/restore GB/s (bf16, page 16; ceiling = pinned memcpy, same run)", ""]
    out += ["| model | tokens | MiB | " + " | ".join(cols) + " |", "|---" * (3 + len(cols)) + "|"]
    for row in rows:
        cells = [row["model"], str(row["tokens"]), f"{row['MiB']:.1f}"]
        out.append("| " + " | ".join(cells + [_num(row[c]) for c in cols]) + " |")
    return out


def _resume_table(entry: dict[str, Any]) -> list[str]:
    rows = entry.get("results")
    if not rows:
        return []
    out = ["", "Resume after flush_cache, 8B-shaped model (median of repeats)", ""]
    out += ["| partial tokens | re-prefill s | restore s | speed-up | cached tokens |"]
    out += ["|---|---|---|---|---|"]
    for x in rows:
        out.append(
            f"| {x['partial_tokens']} | {x['recompute_s']:.3f} | {x['restore_s']:.3f} | "
            f"x{x['speedup']:.2f} | {x['restored_cached_tokens']} |"
        )
    return out


def _bench_table(entry: dict[str, Any]) -> list[str]:
    rows = entry.get("results")
    if not rows:
        return []
    out = ["", "april-bench on the 8B-shaped model", ""]
    out += ["| mode | output tok/s | x sync | checks ok |", "|---|---|---|---|"]
    for x in rows:
        ratio = x.get("output_throughput_vs_sync")
        out.append(
            f"| {x['mode']} | {_num(x.get('output_throughput'))} | "
            f"{'—' if ratio is None else f'x{ratio:.2f}'} | {x.get('checks_ok')} |"
        )
    return out

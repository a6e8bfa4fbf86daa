"""Resume time of a partial sample: KV restore vs re-prefill, on a real CPU april-server.

Not a test. For each model and partial length L: two identical greedy samples with an L-token
context are interrupted with a snapshot; SGLang's radix cache is flushed (so only the
snapshot can avoid a prefill); one is resumed with `kv: recompute`, the other with
`kv: restore`; both then decode the same few remaining tokens. Printed side by side, from
one run:

    python -m april_bench.resume [--models tiny,smollm2] [--lengths 1024,4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx

from april_server.launcher import LaunchedServer

R = "/april/v1"
TAIL = 6  # tokens generated after the interruption (same for both paths)


def _ok(r: httpx.Response) -> Any:
    if r.status_code != 200:
        raise RuntimeError(f"{r.request.url}: {r.status_code} {r.text[:300]}")
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text


def interrupted_pair(c: httpx.Client, tag: str, length: int) -> None:
    """Two identical samples (`{tag}/0`, `{tag}/1`) with a `length`-token context, interrupted."""
    prompt = [100 + (i * 7919) % 300 for i in range(length - 4)]
    params = {"temperature": 0.0, "ignore_eos": True}
    body = {
        "groups": [
            {
                "group_id": tag,
                "input_ids": prompt,
                "n": 2,
                "sampling_params": {**params, "max_new_tokens": 4 + TAIL},
            },
            {
                "group_id": tag + "-t",
                "input_ids": [1, 2],
                "n": 1,
                "sampling_params": {**params, "max_new_tokens": 3},
            },
        ],
        "target_groups": 1,
        "on_quota": "snapshot",
        "resume_first": False,
    }
    _ok(c.post(R + "/rollouts", json=body))
    c.delete(f"{R}/partials/{tag}-t")


def timed_resume(c: httpx.Client, sample_id: str, kv: str) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    out = _ok(c.post(R + "/resume", json={"sample_ids": [sample_id], "kv": kv}))
    return time.perf_counter() - t0, out["samples"][0]


def bench_model(model: str, lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    extra = ["--april-model", model] if model != "tiny" else []
    with LaunchedServer(extra) as srv, httpx.Client(base_url=srv.url, timeout=1800) as c:
        for length in lengths:
            rec, res, cached = [], [], []
            for k in range(repeats):
                tag = f"L{length}-{k}"
                interrupted_pair(c, tag, length)
                _ok(c.post("/flush_cache"))
                t_rec, s_rec = timed_resume(c, f"{tag}/0", "recompute")
                _ok(c.post("/flush_cache"))
                t_res, s_res = timed_resume(c, f"{tag}/1", "restore")
                assert s_res["segments"][-1]["kv"] == "restored", s_res["segments"]
                if s_rec["output_ids"] != s_res["output_ids"]:
                    print(f"  note: {tag}: restore and re-prefill outputs differ (float drift)")
                rec.append(t_rec)
                res.append(t_res)
                cached.append(s_res["segments"][-1]["cached_tokens"])
                c.delete(f"{R}/partials/{tag}")
            stats = _ok(c.get(R + "/stats"))
            rows.append(
                {
                    "model": model,
                    "partial_tokens": length,
                    "recompute_s": statistics.median(rec),
                    "restore_s": statistics.median(res),
                    "speedup": statistics.median(rec) / statistics.median(res),
                    "restored_cached_tokens": min(cached),
                    "restore_gbps_mean": stats.get("restore_gbps_mean"),
                }
            )
            print(_row(rows[-1]), flush=True)
    return rows


def _row(r: dict[str, Any]) -> str:
    return (
        f"| {r['model']} | {r['partial_tokens']} | {r['recompute_s']:.3f} | {r['restore_s']:.3f}"
        f" | x{r['speedup']:.2f} | {r['restored_cached_tokens']} | {r['restore_gbps_mean']} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(
        f"resume after interruption + flush_cache; {TAIL} tokens decoded after; median of "
        f"{args.repeats}; CPU"
    )
    print(
        "| model | partial tokens | re-prefill s | restore s | speed-up | cached tokens "
        "(restore) | restore GB/s (mean) |"
    )
    print("|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        bench_model(model, lengths, args.repeats)


if __name__ == "__main__":
    main()

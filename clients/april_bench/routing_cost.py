"""What routing replay costs on the tiny MoE, on a real CPU april-server (`make bench-routing`).

Not a test. Two servers on the tiny MoE, up side by side and used one at a time: one without
routed-experts capture, one with it (`--april-model tiny-moe` turns it on). The same greedy call
(groups x n samples, every sample to its budget) runs on the first, and on the second with
`return_routed_experts` off and on, in rotated order, the radix cache flushed before each;
printed side by side: output tokens per wall second, the server's CPU seconds per 1k output
tokens (its whole process tree: robust to other load on the machine, which stretches wall time
but not the work done) and response bytes per output token; then the routing's own bytes per
position, on the wire (base64 in JSON) and in a KV snapshot (int32
rows beside the KV, `/stats` `snapshot_routing_bytes`):

    python -m april_bench.routing_cost [--groups 8] [--n 4] [--max-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import httpx

from april_server.launcher import LaunchedServer, start_all

R = "/april/v1"


def _ok(r: httpx.Response) -> Any:
    if r.status_code != 200:
        raise RuntimeError(f"{r.request.url}: {r.status_code} {r.text[:300]}")
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text


def _groups(tag: str, groups: int, n: int, max_tokens: int) -> list[dict[str, Any]]:
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": max_tokens}
    return [
        {
            "group_id": f"{tag}-{g}",
            "input_ids": [5 + g, 9, 11, 13 + g],
            "n": n,
            "sampling_params": params,
            "seed": g,
        }
        for g in range(groups)
    ]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants (SGLang's scheduler and
    detokenizer are children of the HTTP process)."""
    import psutil

    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        total += t.user + t.system
    return total


def one_call(
    c: httpx.Client, tag: str, args: argparse.Namespace, routing: bool, pid: int
) -> dict[str, Any]:
    _ok(c.post("/flush_cache"))
    body = {
        "groups": _groups(tag, args.groups, args.n, args.max_tokens),
        "target_groups": args.groups,
        "max_inflight_groups": args.groups,
        "return_routed_experts": routing,
    }
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    r = c.post(R + "/rollouts", json=body)
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    out = _ok(r)
    samples = [s for g in out["groups"] for s in g["samples"]]
    tokens = sum(len(s["output_ids"]) for s in samples)
    positions = sum(len(s["prompt_ids"]) + len(s["output_ids"]) - 1 for s in samples)
    routing_wire = sum(len(json.dumps(s["routing"])) for s in samples if s["routing"])
    return {
        "tokens_per_s": tokens / wall,
        "cpu_s_per_1k_tokens": 1000 * cpu / tokens,
        "resp_bytes_per_token": len(r.content) / tokens,
        "routing_wire_bytes_per_position": routing_wire / positions if routing else 0.0,
    }


def snapshot_cost(c: httpx.Client) -> dict[str, float]:
    """Interrupt one long sample with a snapshot: its KV and routing bytes per token."""
    before = _ok(c.get(R + "/stats"))
    params = {"temperature": 0.0, "ignore_eos": True}
    body = {
        "groups": [
            {
                "group_id": "snap",
                "input_ids": [7, 8, 9],
                "sampling_params": {**params, "max_new_tokens": 400},
            },
            {
                "group_id": "snap-t",
                "input_ids": [1, 2],
                "sampling_params": {**params, "max_new_tokens": 200},
            },
        ],
        "target_groups": 1,
        "on_quota": "snapshot",
        "resume_first": False,
        "max_inflight_groups": 2,
        "return_routed_experts": True,
    }
    _ok(c.post(R + "/rollouts", json=body))
    s = _ok(c.get(R + "/partials/snap"))["samples"][0]
    after = _ok(c.get(R + "/stats"))
    tokens = len(s["prompt_ids"]) + len(s["output_ids"]) - 1
    routing = after["snapshot_routing_bytes"] - before["snapshot_routing_bytes"]
    c.delete(R + "/partials/snap")
    return {
        "snapshot_tokens": tokens,
        "snapshot_bytes_per_token": s["snapshot_bytes"] / tokens,
        "snapshot_routing_bytes_per_token": routing / tokens,
    }


def main() -> None:
    from april_server.models import ensure_tiny_moe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    modes = ("no capture", "capture, not asked", "capture, asked")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    # --model-path given: the launcher adds no capture flag (cli.build_argv)
    plain = LaunchedServer(["--model-path", str(ensure_tiny_moe())])
    capture = LaunchedServer(["--april-model", "tiny-moe"])
    try:
        start_all([plain, capture])  # inside: a start that times out still stops both
        with (
            httpx.Client(base_url=plain.url, timeout=1800) as p,
            httpx.Client(base_url=capture.url, timeout=1800) as c,
        ):
            pids = {"p": _pid(plain), "c": _pid(capture)}
            one_call(p, "warm", args, False, pids["p"])  # first-call costs out of the figures
            one_call(c, "warm", args, True, pids["c"])
            for k in range(args.repeats):
                for i in range(len(modes)):
                    mode = modes[(i + k) % len(modes)]
                    which = "p" if mode == "no capture" else "c"
                    client = p if which == "p" else c
                    asked = mode == modes[2]
                    runs[mode].append(one_call(client, f"r{k}-{i}", args, asked, pids[which]))
            snap = snapshot_cost(c)
    finally:
        plain.stop()
        capture.stop()

    def med(mode: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[mode]))

    base = med(modes[0], "tokens_per_s")
    result: dict[str, Any] = {
        "config": vars(args),
        **{f"tokens_per_s[{m}]": med(m, "tokens_per_s") for m in modes},
        **{f"cpu_s_per_1k_tokens[{m}]": med(m, "cpu_s_per_1k_tokens") for m in modes},
        **{f"resp_bytes_per_token[{m}]": med(m, "resp_bytes_per_token") for m in modes},
        "routing_wire_bytes_per_position": med(modes[2], "routing_wire_bytes_per_position"),
        **snap,
        "runs": runs,  # every call's figures, in run order per mode
    }
    print(
        f"tiny MoE (2 layers, 8 experts, top-2), CPU; {args.groups}x{args.n} samples of "
        f"{args.max_tokens} tokens, greedy; median of {args.repeats}, rotated"
    )
    cpu_base = med(modes[0], "cpu_s_per_1k_tokens")
    print(
        "| server / call | output tok/s | vs no capture | server CPU s / 1k tokens | vs no "
        "capture | response bytes / output token |"
    )
    print("|---|---|---|---|---|---|")
    for m in modes:
        tps, cpu = med(m, "tokens_per_s"), med(m, "cpu_s_per_1k_tokens")
        resp = med(m, "resp_bytes_per_token")
        print(
            f"| {m} | {tps:.1f} | x{tps / base:.2f} | {cpu:.3f} | x{cpu / cpu_base:.2f} | "
            f"{resp:.1f} |"
        )
    print(
        f"routing on the wire: {result['routing_wire_bytes_per_position']:.2f} bytes/position "
        f"(JSON, base64); snapshot of {snap['snapshot_tokens']} tokens: "
        f"{snap['snapshot_bytes_per_token']:.1f} bytes/token, of which routing "
        f"{snap['snapshot_routing_bytes_per_token']:.1f}"
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


def _pid(server: LaunchedServer) -> int:
    assert server.proc is not None, "started"
    return int(server.proc.pid)


if __name__ == "__main__":
    main()

"""What routing replay costs on the tiny MoE, on a real CPU april-server (`make bench-routing`).

Not a test. One server (`--april-model tiny-moe`, capture on); the same greedy call (groups x n
samples, every sample to its budget) is run with `return_routed_experts` off and on, alternated,
the radix cache flushed before each, and printed side by side: output tokens per wall second and
response bytes per output token; then the routing's own bytes per position, on the wire (base64
in JSON) and in a KV snapshot (int32 rows beside the KV, `/stats` `snapshot_routing_bytes`):

    python -m april_client.bench.routing [--groups 8] [--n 4] [--max-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import httpx

from april_client.bench.launcher import LaunchedServer

R = "/april/v1"


def _ok(r: httpx.Response) -> Any:
    if r.status_code != 200:
        raise RuntimeError(f"{r.request.url}: {r.status_code} {r.text[:300]}")
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text


def _groups(tag: str, groups: int, n: int, max_tokens: int) -> list[dict[str, Any]]:
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": max_tokens}
    return [
        {"group_id": f"{tag}-{g}", "input_ids": [5 + g, 9, 11, 13 + g], "n": n,
         "sampling_params": params, "seed": g}
        for g in range(groups)
    ]  # fmt: skip


def one_call(c: httpx.Client, tag: str, args: argparse.Namespace, routing: bool) -> dict[str, Any]:
    _ok(c.post("/flush_cache"))
    body = {
        "groups": _groups(tag, args.groups, args.n, args.max_tokens),
        "target_groups": args.groups,
        "max_inflight_groups": args.groups,
        "return_routed_experts": routing,
    }
    t0 = time.perf_counter()
    r = c.post(R + "/rollouts", json=body)
    wall = time.perf_counter() - t0
    out = _ok(r)
    samples = [s for g in out["groups"] for s in g["samples"]]
    tokens = sum(len(s["output_ids"]) for s in samples)
    positions = sum(len(s["prompt_ids"]) + len(s["output_ids"]) - 1 for s in samples)
    routing_wire = sum(len(json.dumps(s["routing"])) for s in samples if s["routing"])
    return {
        "tokens_per_s": tokens / wall,
        "resp_bytes_per_token": len(r.content) / tokens,
        "routing_wire_bytes_per_position": routing_wire / positions if routing else 0.0,
    }


def snapshot_cost(c: httpx.Client) -> dict[str, float]:
    """Interrupt one long sample with a snapshot: its KV and routing bytes per token."""
    before = _ok(c.get(R + "/stats"))
    params = {"temperature": 0.0, "ignore_eos": True}
    body = {
        "groups": [
            {"group_id": "snap", "input_ids": [7, 8, 9], "sampling_params":
             {**params, "max_new_tokens": 400}},
            {"group_id": "snap-t", "input_ids": [1, 2], "sampling_params":
             {**params, "max_new_tokens": 40}},
        ],
        "target_groups": 1, "on_quota": "snapshot", "resume_first": False,
        "max_inflight_groups": 2, "return_routed_experts": True,
    }  # fmt: skip
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    with (
        LaunchedServer(["--april-model", "tiny-moe"]) as srv,
        httpx.Client(base_url=srv.url, timeout=1800) as c,
    ):
        one_call(c, "warm", args, True)  # first-call costs (imports, pool) out of the figures
        for k in range(args.repeats):
            for routing in (False, True) if k % 2 == 0 else (True, False):
                runs[routing].append(one_call(c, f"r{k}-{int(routing)}", args, routing))
        snap = snapshot_cost(c)

    def med(routing: bool, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[routing]))

    result: dict[str, Any] = {
        "config": vars(args),
        "tokens_per_s_off": med(False, "tokens_per_s"),
        "tokens_per_s_on": med(True, "tokens_per_s"),
        "resp_bytes_per_token_off": med(False, "resp_bytes_per_token"),
        "resp_bytes_per_token_on": med(True, "resp_bytes_per_token"),
        "routing_wire_bytes_per_position": med(True, "routing_wire_bytes_per_position"),
        **snap,
    }
    on, off = result["tokens_per_s_on"], result["tokens_per_s_off"]
    print(f"tiny MoE (2 layers, 8 experts, top-2), CPU; {args.groups}x{args.n} samples of "
          f"{args.max_tokens} tokens, greedy; median of {args.repeats}, alternated")  # fmt: skip
    print("| routing | output tok/s | response bytes / output token |")
    print("|---|---|---|")
    print(f"| off | {off:.1f} | {result['resp_bytes_per_token_off']:.1f} |")
    print(f"| on | {on:.1f} (x{on / off:.2f}) | {result['resp_bytes_per_token_on']:.1f} |")
    print(f"routing on the wire: {result['routing_wire_bytes_per_position']:.2f} bytes/position "
          f"(JSON, base64); snapshot of {snap['snapshot_tokens']} tokens: "
          f"{snap['snapshot_bytes_per_token']:.1f} bytes/token, of which routing "
          f"{snap['snapshot_routing_bytes_per_token']:.1f}")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

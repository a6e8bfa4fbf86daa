"""Measure the simulator's cost model on a live server: decode-iteration time t(b) = a + c x b
at a few running-batch sizes, and the prefill cost per token.

Each probe sends b concurrent requests shaped like the rollouts' (distinct random prompts, so no
prefix-cache hits; `ignore_eos`; logprobs returned). Time per iteration at batch b =
(wall with T+1 new tokens - wall with 1) / T, so request overheads and prefill cancel out. Every
point is the best of `repeats` tries, which discounts interference from other work on a shared
machine.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import numpy as np

from .server_api import check
from .simulate import CostModel

BATCHES = (1, 4, 16, 32, 64)
DECODE_TOKENS = 64
SHORT, LONG = 16, 1024


async def _timed(
    http: httpx.AsyncClient, rng: np.random.Generator, vocab: int, b: int, plen: int, new: int
) -> float:
    def body() -> dict[str, Any]:
        ids = [int(x) for x in rng.integers(3, max(4, vocab), size=plen)]
        params = {"max_new_tokens": new, "ignore_eos": True, "temperature": 1.0}
        return {"input_ids": ids, "sampling_params": params, "return_logprob": True}

    t0 = time.perf_counter()
    resps = await asyncio.gather(*(http.post("/generate", json=body()) for _ in range(b)))
    for r in resps:
        check(r, "calibration /generate")
    return time.perf_counter() - t0


async def measure_cost_model(
    http: httpx.AsyncClient, vocab: int, context_len: int = 4096, repeats: int = 2, seed: int = 0
) -> tuple[CostModel, list[tuple[int, float]]]:
    """(fitted cost model, measured (batch, seconds per iteration) points)."""
    rng = np.random.default_rng(seed)

    async def best(b: int, plen: int, new: int) -> float:
        return min([await _timed(http, rng, vocab, b, plen, new) for _ in range(repeats)])

    points = []
    for b in BATCHES:
        base = await best(b, SHORT, 1)
        full = await best(b, SHORT, DECODE_TOKENS + 1)
        points.append((b, max(0.0, full - base) / DECODE_TOKENS))
    long = min(LONG, max(SHORT + 1, context_len // 2))
    prefill_s = max(0.0, (await best(1, long, 1) - await best(1, SHORT, 1)) / (long - SHORT))
    x = np.array([[1.0, b] for b, _ in points])
    y = np.array([t for _, t in points])
    (a, c), *_ = np.linalg.lstsq(x, y, rcond=None)
    a, c = max(float(a), 0.0), max(float(c), 0.0)
    err = float(np.mean(np.abs(x @ np.array([a, c]) - y) / np.maximum(y, 1e-9)))
    cost = CostModel(
        "measured on this server (decode probes at batch " + ", ".join(map(str, BATCHES)) + ")",
        a=a,
        c=c,
        prefill_s=prefill_s,
        restore_s=0.0,
        assumptions=(
            "t(b) points (ms/iteration): "
            + ", ".join(f"b={b}: {t * 1e3:.2f}" for b, t in points)
            + f"; linear fit mean abs error {100 * err:.1f}%",
            f"prefill {prefill_s * 1e6:.1f} us/token from a {long}-token prompt",
            "restore is free in the model (snapshot copy cost not probed)",
            "not modelled: HTTP submission of K x n requests per sync step, abort/drain and "
            "bookkeeping per APRIL step (on 2 CPUs these are a visible share of a step)",
        ),
    )
    return cost, points

"""Engine-side measurements the scheduler hook feeds (plain Python, testable without SGLang):
decode step time by running-batch size (the in-flight policy's curve) and seconds per forward
kind (where a rollout's engine time goes). Batches are duck-typed: `forward_mode.is_decode()`,
`forward_mode.is_extend()`, `batch_size()`, `extend_num_tokens`."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from typing import Any


class StepTimer:
    """Decode step time by running-batch size: the gap between consecutive decode steps
    (it includes scheduling overhead, which is a real per-step cost), with the context those
    steps attended (sum of sequence lengths), since a step over longer contexts costs more at
    the same batch size."""

    MAX_GAP_S = 2.0  # a longer gap means the engine idled or prefilled in between

    def __init__(self) -> None:
        # batch size -> [steps, sum t, sum t^2, sum ctx, sum ctx^2, sum t*ctx]
        self.sums: dict[int, list[float]] = {}
        self.last: tuple[float, int, int] | None = None

    def on_batch(self, batch: Any, started_at: float | None = None) -> None:
        """`started_at`: when the batch's step began (default: now)."""
        now = time.perf_counter() if started_at is None else started_at
        if batch is None or not batch.forward_mode.is_decode():
            self.last = None
            return
        if self.last is not None and now - self.last[0] < self.MAX_GAP_S:
            gap, ctx = now - self.last[0], float(self.last[2])
            acc = self.sums.setdefault(self.last[1], [0.0] * 6)
            for i, v in enumerate((1.0, gap, gap * gap, ctx, ctx * ctx, gap * ctx)):
                acc[i] += v
        context = int(getattr(batch, "seq_lens_sum", 0) or 0)
        self.last = (now, int(batch.batch_size()), context)

    def curve(self, min_count: int = 3) -> dict[str, list[float]]:
        """Batch size -> [steps, mean s, std s, mean context, S_tc, S_cc], where S_tc and S_cc
        are the centred sums (co-variation of time with context, and of context with itself)
        the policy pools into one seconds-per-context-token slope."""
        out: dict[str, list[float]] = {}
        for b, (n, t, t2, c, c2, tc) in sorted(self.sums.items()):
            if n >= min_count:
                mean_t, mean_c = t / n, c / n
                std_t = math.sqrt(max(t2 - n * mean_t * mean_t, 0.0) / max(n - 1, 1))
                s_tc, s_cc = tc - n * mean_t * mean_c, max(c2 - n * mean_c * mean_c, 0.0)
                out[str(b)] = [n, mean_t, std_t, mean_c, s_tc, s_cc]
        return out


def batch_bucket(size: int) -> int:
    """The lower edge of `size`'s decode-batch bucket: half an octave wide (1, 2, 3, 4, 6, 8,
    11, 16, 23, 32, 45, 64, 91, 128, ...), so a reader can split decode time at any of them
    (at a full batch or below it) with at most ~25 keys up to 4096 running requests."""
    if size < 1:
        return 0
    k = 2 * (size.bit_length() - 1)  # the power of two at or below `size`
    if bucket_edge(k + 1) <= size:
        k += 1
    return bucket_edge(k)


def bucket_edge(k: int) -> int:
    return max(1, round(2 ** (k / 2)))


class EngineClock:
    """Seconds inside `run_batch` and tokens processed, by forward kind: how much of a rollout
    the engine spent prefilling (re-prefill of continuations included) vs decoding, and decode
    seconds by batch size (`batch_bucket`: `decode_s_b<edge>`, `decode_batches_b<edge>`,
    `decode_tokens_b<edge>`), which separates forwards at a full batch from the tail's. On CPU
    the forward runs inside the call, so this is compute time; with SGLang's overlap scheduler
    on a GPU it is launch time only and undercounts. `idle_s`: seconds with no batch to run."""

    RECENT_S = 60  # `/stats` `engine_idle_share` looks this far back

    def __init__(self, now: Any = time.monotonic) -> None:
        self.now = now
        self.started = now()
        # Busy seconds per wall second, newest last, at most RECENT_S + 1 entries: the idle
        # share of the last minute costs O(60) to read, whatever the server's age.
        self.recent: deque[list[float]] = deque()
        self.totals = {"prefill": [0.0, 0, 0], "decode": [0.0, 0, 0]}  # seconds, batches, tokens
        # Context attended by decode steps (sum of sequence lengths): with the same batch size a
        # step over longer contexts costs more, so this separates "bigger batch" from "longer".
        self.decode_context_tokens = 0
        self.prefill_requests = 0  # each makes its request's first token (prefill_tokens: input)
        # Seconds the scheduler found no batch to run (SGLang's idle housekeeping and sleep):
        # the engine waiting for work, as opposed to its own scheduling between forwards.
        self.idle_s = 0.0
        self.decode_by_bucket: dict[int, list[float]] = {}  # edge -> [seconds, batches, tokens]

    def add(self, batch: Any, seconds: float) -> None:
        if batch is None:
            return
        mode = batch.forward_mode
        if mode.is_decode():
            acc, tokens = self.totals["decode"], int(batch.batch_size())
            self.decode_context_tokens += int(getattr(batch, "seq_lens_sum", 0) or 0)
            bucket = self.decode_by_bucket.setdefault(batch_bucket(tokens), [0.0, 0, 0])
            bucket[0] += seconds
            bucket[1] += 1
            bucket[2] += tokens
        elif mode.is_extend():  # prefill, chunked prefill, mixed
            acc, tokens = self.totals["prefill"], int(getattr(batch, "extend_num_tokens", 0) or 0)
            self.prefill_requests += int(batch.batch_size())
        else:  # idle batches (data parallel padding) cost nothing worth counting
            return
        acc[0] += seconds
        acc[1] += 1
        acc[2] += tokens
        second = float(int(self.now()))
        if self.recent and self.recent[-1][0] == second:
            self.recent[-1][1] += seconds
        else:
            self.recent.append([second, seconds])
        self._forget_old(second)

    def add_idle(self, seconds: float) -> None:
        self.idle_s += seconds

    def _forget_old(self, second: float) -> None:
        while self.recent and self.recent[0][0] < second - self.RECENT_S:
            self.recent.popleft()

    def snapshot(self) -> dict[str, float]:
        now = self.now()
        self._forget_old(float(int(now)))
        uptime = now - self.started
        # Sums over ranks and engines (merge_rank_stats) stay right: busy over capacity.
        out: dict[str, float] = {
            "uptime_s": round(uptime, 6),
            "recent_busy_s": round(sum(b for _, b in self.recent), 6),
            "recent_window_s": round(min(uptime, float(self.RECENT_S)), 6),
        }
        for kind, (seconds, batches, tokens) in self.totals.items():
            out[f"{kind}_s"], out[f"{kind}_batches"] = round(seconds, 6), batches
            out[f"{kind}_tokens"] = tokens
        out["decode_context_tokens"] = self.decode_context_tokens
        out["prefill_requests"] = self.prefill_requests
        out["idle_s"] = round(self.idle_s, 6)
        for edge, (seconds, batches, tokens) in sorted(self.decode_by_bucket.items()):
            out[f"decode_s_b{edge}"] = round(seconds, 6)
            out[f"decode_batches_b{edge}"] = batches
            out[f"decode_tokens_b{edge}"] = tokens
        return out


def idle_shares(clock: Mapping[str, float]) -> dict[str, float | None]:
    """The engine's idle share from a (merged) clock snapshot: over the last minute and since
    start-up; None before any time has passed. Busy is time inside `run_batch`, so with a GPU's
    overlap scheduler (launch time only) the share reads high."""

    def share(busy: float, capacity: float) -> float | None:
        return None if capacity <= 0 else round(min(max(1.0 - busy / capacity, 0.0), 1.0), 4)

    busy_total = clock.get("prefill_s", 0.0) + clock.get("decode_s", 0.0)
    return {
        "engine_idle_share": share(
            clock.get("recent_busy_s", 0.0), clock.get("recent_window_s", 0.0)
        ),
        "engine_idle_share_since_start": share(busy_total, clock.get("uptime_s", 0.0)),
    }

"""The scheduler-side clocks on stand-in batches (the hooks' arithmetic, without SGLang)."""

from __future__ import annotations

from dataclasses import dataclass

from april_server.engine.clock import EngineClock, StepTimer, batch_bucket, idle_shares


@dataclass
class Mode:
    kind: str

    def is_decode(self) -> bool:
        return self.kind == "decode"

    def is_extend(self) -> bool:
        return self.kind in ("extend", "mixed")


@dataclass
class Batch:
    kind: str
    size: int
    extend_num_tokens: int | None = None
    seq_lens_sum: int | None = None

    @property
    def forward_mode(self) -> Mode:
        return Mode(self.kind)

    def batch_size(self) -> int:
        return self.size


def test_engine_clock_splits_prefill_and_decode() -> None:
    clock = EngineClock()
    clock.add(Batch("extend", 2, extend_num_tokens=300), 0.5)
    clock.add(Batch("decode", 8, seq_lens_sum=800), 0.01)
    clock.add(Batch("decode", 6, seq_lens_sum=90), 0.02)
    clock.add(Batch("mixed", 3, extend_num_tokens=40), 0.1)
    clock.add(Batch("idle", 0), 9.0)  # not work: not counted
    clock.add(None, 9.0)
    snap = clock.snapshot()
    assert snap["prefill_s"] == 0.6 and snap["prefill_batches"] == 2
    assert snap["prefill_tokens"] == 340
    assert snap["decode_s"] == 0.03 and snap["decode_batches"] == 2
    assert snap["decode_tokens"] == 14 and snap["decode_context_tokens"] == 890


def test_step_timer_counts_gaps_between_decode_steps_only() -> None:
    timer, now = StepTimer(), [0.0]
    import april_server.engine.clock as hooks

    real = hooks.time.perf_counter
    hooks.time.perf_counter = lambda: now[0]  # type: ignore[assignment]
    try:
        for t, batch in [
            (0.0, Batch("decode", 4, seq_lens_sum=40)),
            (0.1, Batch("decode", 4, seq_lens_sum=44)),
            (0.2, Batch("decode", 4, seq_lens_sum=48)),
            (0.3, Batch("decode", 4, seq_lens_sum=52)),
            (0.4, Batch("extend", 1, 50)),
            (0.9, Batch("decode", 5)),
        ]:
            now[0] = t
            timer.on_batch(batch)
    finally:
        hooks.time.perf_counter = real  # type: ignore[assignment]
    # Three decode->decode gaps at batch 4 count; the gap that ends in a prefill and the one
    # across it do not (they hold prefill time, not a decode step).
    curve = timer.curve(min_count=1)
    assert set(curve) == {"4"}
    steps, mean, std, context, s_tc, s_cc = curve["4"]
    assert steps == 3 and abs(mean - 0.1) < 1e-9 and std < 1e-6
    # Each gap is charged to the step that opened it, with that step's context: 40, 44, 48.
    assert context == 44 and abs(s_cc - 32) < 1e-9 and abs(s_tc) < 1e-9


def test_idle_share_covers_the_last_minute_and_the_time_since_start() -> None:
    now = [1000.0]
    clock = EngineClock(now=lambda: now[0])
    now[0] = 1010.0
    clock.add(Batch("decode", 4, seq_lens_sum=40), 2.0)  # 2 s busy out of the first 10
    snap = clock.snapshot()
    assert snap["recent_busy_s"] == 2.0 and snap["recent_window_s"] == 10.0
    assert idle_shares(snap) == {"engine_idle_share": 0.8, "engine_idle_share_since_start": 0.8}
    now[0] = 1100.0
    clock.add(Batch("extend", 1, extend_num_tokens=9), 30.0)
    snap = clock.snapshot()
    # The busy second at t=1010 has left the minute; since start: 32 s busy of 100.
    assert snap["recent_busy_s"] == 30.0 and snap["recent_window_s"] == 60.0
    assert idle_shares(snap) == {"engine_idle_share": 0.5, "engine_idle_share_since_start": 0.68}
    now[0] = 1200.0  # a quiet minute: fully idle, and the ring holds nothing older
    assert idle_shares(clock.snapshot())["engine_idle_share"] == 1.0 and not clock.recent
    # Merged over two ranks (sums), the share is busy over both ranks' capacity.
    merged = {"recent_busy_s": 30.0, "recent_window_s": 120.0, "uptime_s": 0.0}
    assert idle_shares(merged) == {"engine_idle_share": 0.75, "engine_idle_share_since_start": None}


# A batch size -> the lower edge of its bucket (1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, 91, ...).
BUCKETS = {1: 1, 2: 2, 3: 3, 5: 4, 7: 6, 8: 8, 10: 8, 11: 11, 16: 16, 22: 16, 23: 23, 90: 64,
           91: 91, 128: 128, 300: 256}  # fmt: skip


def test_decode_time_is_kept_by_half_octave_batch_bucket() -> None:
    assert {b: batch_bucket(b) for b in BUCKETS} == BUCKETS
    clock = EngineClock()
    clock.add(Batch("decode", 30), 0.01)
    clock.add(Batch("decode", 24), 0.02)
    clock.add(Batch("decode", 100), 0.04)
    clock.add(Batch("extend", 3, extend_num_tokens=90), 0.5)
    snap = clock.snapshot()
    assert snap["decode_s_b23"] == 0.03 and snap["decode_batches_b23"] == 2
    assert snap["decode_tokens_b23"] == 54
    assert snap["decode_s_b91"] == 0.04 and snap["decode_tokens_b91"] == 100
    assert "decode_s_b32" not in snap  # only buckets that ran
    assert snap["prefill_requests"] == 3  # one first token each
    clock.add_idle(0.25)
    clock.add_idle(0.5)
    assert clock.snapshot()["idle_s"] == 0.75

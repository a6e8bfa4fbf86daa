"""Synthetic buffered groups: big buffers for the buffer benchmark and its tests, no model.

Each group looks like what a long-tail rollout leaves behind: `n` members sharing a prompt,
each with part of its budget generated (token ids and logprobs) under weight version "0",
status `partial`, so a call can resume it on the embedded tiny model.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

from april_client.protocol import Group, Sample, Segment
from april_server.buffer.buffer_index import BufferEntry, summarize
from april_server.buffer.store import BufferStore


def synthetic_group(
    group_id: str,
    rng: random.Random,
    n: int = 4,
    prompt_len: int = 16,
    output_len: int = 32,
    budget: int = 48,
    vocab: int = 256,
    created_at: float = 0.0,
) -> Group:
    prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]  # 0-2: specials, no EOS
    samples = []
    for i in range(n):
        out = [rng.randrange(3, vocab) for _ in range(output_len)]
        samples.append(
            Sample(
                sample_id=f"{group_id}/{i}",
                group_id=group_id,
                index=i,
                status="partial",
                prompt_ids=prompt,
                output_ids=out,
                output_logprobs=[-0.5] * output_len,
                segments=[Segment(0, output_len, "0", "fresh", "abort")] if output_len else [],
                max_new_tokens=budget,
                finish_reason=None,
                sampling_params={"temperature": 0.0, "ignore_eos": True},
            )
        )
    return Group(group_id=group_id, samples=samples, created_at=created_at)


def fill(
    store: BufferStore,
    num_groups: int,
    prefix: str = "syn",
    seed: int = 0,
    chunk: int = 10_000,
    **shape: int,
) -> None:
    """Write `num_groups` synthetic groups into `store` (oldest first), in chunks."""
    rng = random.Random(seed)
    t0 = time.time() - num_groups * 1e-3
    seq = 1 + max((e.seq for e in store.load_index()), default=0)

    def rows(start: int, stop: int) -> Iterator[tuple[Group, BufferEntry]]:
        for k in range(start, stop):
            g = synthetic_group(f"{prefix}-{k}", rng, created_at=t0 + k * 1e-3, **shape)
            yield g, summarize(g, seq + k)

    for start in range(0, num_groups, chunk):
        store.bulk_put(rows(start, min(num_groups, start + chunk)))

"""`AprilRollout(sampling_mask=True)` (trl.py) against a fake server: it asks for masks on its
calls and prefetches, returns logprobs over the kept sets, and hands TRL's generation step the
rows' kept sets in row order (trl_correction.py trains over them)."""

from __future__ import annotations

from typing import Any

import pytest

from april_client.protocol import RolloutResp, SamplingMask
from april_client.trl import AprilRollout
from tests.unit.client.test_trl_background import FakeServer, N, P, _dataset, _trainer

# Every fake sample generates [1, 2]: token 1 kept {1, 5}, token 2 kept alone (greedy).
MASK = SamplingMask("uint16", bytes([1, 0, 5, 0, 2, 0]), bytes([2, 0, 1, 0]), [-0.05, 0.0])


class MaskServer(FakeServer):
    def rollout(self, specs: list[dict[str, Any]], target: int, **kw: Any) -> RolloutResp:
        resp = super().rollout(specs, target, **kw)
        for g in resp.groups:
            for s in g.samples:
                s.return_sampling_mask, s.sampling_mask = True, MASK
        return resp


def test_rows_carry_kept_set_logprobs_and_the_trainer_gets_their_kept_sets() -> None:
    server = MaskServer()
    adapter = AprilRollout(
        server,  # type: ignore[arg-type]
        sampling_mask=True,
        background=True,
        push_weights=False,
        run_id="t",
    )
    data = _dataset()
    trainer = _trainer(data, 0)
    trainer.top_k = 20
    trainer._get_per_token_logps_and_entropies = None  # TRL's, hooked at the first call
    prompts = [data[g]["prompt"] for g in range(P) for _ in range(N)]
    out = adapter(prompts, trainer)
    assert all(c["return_sampling_mask"] for c in server.calls)
    assert server.prefetches and all(p["return_sampling_mask"] for p in server.prefetches)
    assert out["logprobs"] == [[-0.05, 0.0]] * (P * N)  # over the kept sets, not -0.1
    (table,) = trainer.__dict__["_april_kept_tables"]  # the call's rows, found by their tokens
    kept = [r for rows in table.values() for r in rows]
    assert [(r.completion_ids, r.ids, r.offsets) for r in kept] == [
        ([1, 2], [1, 5, 2], [0, 2, 3])
    ] * (P * N)
    assert sorted(r.prompt_ids for r in kept) == sorted(out["prompt_ids"])
    assert trainer.__dict__["_april_kept_sets"]  # hooked
    assert all(c["specs"][0]["sampling_params"]["top_k"] == 20 for c in server.calls)


def test_masks_without_a_top_k_are_a_clear_error() -> None:
    adapter = AprilRollout(MaskServer(), sampling_mask=True, push_weights=False)  # type: ignore[arg-type]
    data = _dataset()
    with pytest.raises(ValueError, match="GRPOConfig\\(top_k=...\\)"):
        adapter([data[0]["prompt"]] * N, _trainer(data, 0))

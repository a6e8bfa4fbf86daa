"""Sample rules (`rules/samples.py`), pure: what a continuation asks of the engine."""

from __future__ import annotations


def test_a_continuation_owes_only_what_is_left_of_min_new_tokens() -> None:
    """Found by review: a continuation sent the sample's whole `min_new_tokens` with the
    remaining budget as `max_new_tokens`; once fewer than it remained, SGLang refused every
    segment of the sample (min_new_tokens must lie in [0, max_new_tokens]): it never finished,
    and as the oldest buffered group it failed every call that claimed it first."""
    from april_client.protocol import Sample, Segment
    from april_server.rules.samples import plan_continuation

    def partial(generated: int) -> Sample:
        return Sample(
            sample_id="g/0",
            group_id="g",
            index=0,
            status="partial",
            prompt_ids=[1, 2],
            output_ids=[3] * generated,
            output_logprobs=[-0.1] * generated,
            segments=[Segment(0, generated, "0", "fresh", "abort")] if generated else [],
            max_new_tokens=512,
            finish_reason=None,
            sampling_params={"max_new_tokens": 512, "min_new_tokens": 64},
        )

    for generated, owed in ((0, 64), (40, 24), (64, 0), (500, 0)):
        params = plan_continuation(partial(generated), "0", None).sampling_params
        assert params["max_new_tokens"] == 512 - generated
        assert params["min_new_tokens"] == owed
        assert 0 <= params["min_new_tokens"] <= params["max_new_tokens"]

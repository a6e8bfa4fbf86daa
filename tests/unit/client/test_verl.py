"""The verl adapter's parts that need no verl (`april_client.verl`, `verl_batch.py`): its
settings, the request mapping of `AprilLLMServerClient` against a fake server and a stand-in for
verl's `TokenOutput`, the batch's grouping by uid, and the error when verl is missing. verl's own
code is driven by tests/peers/test_verl_e2e.py (`make test-peers`)."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from april_client import verl as adapter
from april_client._framework import MissingFramework
from april_client.protocol import Group, RolloutResp, RolloutStats, Sample, Segment
from april_client.trainer_batch import jsonable
from april_client.verl_batch import uid_blocks


class Cfg(dict[str, Any]):
    """What the adapter reads of verl's DictConfig: `.get` and attributes."""

    def __getattr__(self, name: str) -> Any:
        return self[name]


def config(**april: Any) -> Cfg:
    rollout = Cfg(response_length=16, prompt_length=8)
    return Cfg(april=april, actor_rollout_ref=Cfg(rollout=rollout))


def test_settings_come_from_the_config_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    got = adapter.settings(config(url="http://h:1", over_provision=2.0, max_staleness=1))
    assert (got.url, got.over_provision, got.max_staleness) == ("http://h:1", 2.0, 1)
    monkeypatch.setenv(adapter.URL_ENV, "http://env:2")
    assert adapter.settings(config()).url == "http://env:2"
    monkeypatch.delenv(adapter.URL_ENV)
    with pytest.raises(ValueError, match=r"\+april.url"):
        adapter.settings(config())
    with pytest.raises(ValueError, match="over_provision"):
        adapter.settings(config(url="http://h:1", over_provision=0.5))
    with pytest.raises(ValueError, match="stale_tokens"):
        adapter.settings(config(url="http://h:1", stale_tokens="correct"))


def test_sampling_params_take_verl_s_budget_rules() -> None:
    rollout = config().actor_rollout_ref.rollout
    assert adapter.server_sampling_params({"max_tokens": 5, "logprobs": True}, 3, rollout) == {
        "max_new_tokens": 5
    }
    # no budget: the response length, within the context left by the prompt
    assert adapter.server_sampling_params({"temperature": 1.0}, 3, rollout)["max_new_tokens"] == 16
    assert adapter.server_sampling_params({}, 20, rollout)["max_new_tokens"] == 4


def seg(start: int, end: int, version: str) -> Segment:
    return Segment(start=start, end=end, weight_version=version, kv="fresh")


def answer(spec: dict[str, Any], segments: list[Segment]) -> RolloutResp:
    n = segments[-1].end
    sample = Sample(
        sample_id=f"{spec['group_id']}/0",
        group_id=spec["group_id"],
        index=0,
        status="completed",
        prompt_ids=spec["input_ids"],
        output_ids=list(range(n)),
        output_logprobs=[-1.0] * n,
        segments=segments,
        max_new_tokens=16,
        finish_reason="stop",
    )
    stats = RolloutStats(
        wall_s=0.0,
        weight_version="4",
        num_finished_groups=1,
        num_buffered_groups=0,
        output_tokens=n,
        offpolicy_tokens=0,
        resumed_samples=0,
        restored_kv_tokens=0,
        recomputed_tokens=0,
    )
    return RolloutResp(
        batch_id="b",
        groups=[Group(group_id=spec["group_id"], samples=[sample])],
        buffered_group_ids=[],
        stats=stats,
    )


class FakeAsyncClient:
    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        self.calls: list[dict[str, Any]] = []

    async def rollout(self, specs: list[dict[str, Any]], target: int, **kw: Any) -> RolloutResp:
        self.calls.append({"specs": specs, "target": target, **kw})
        return answer(specs[0], self.segments)


@pytest.fixture()
def token_output() -> Iterator[type]:
    """A stand-in for verl's `TokenOutput` (verl/workers/rollout/replica.py)."""

    class TokenOutput:
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    names = ["verl", "verl.workers", "verl.workers.rollout", "verl.workers.rollout.replica"]
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules["verl.workers.rollout.replica"].TokenOutput = TokenOutput  # type: ignore[attr-defined]
    yield TokenOutput
    for n, m in saved.items():
        if m is None:
            sys.modules.pop(n, None)
        else:
            sys.modules[n] = m


def test_a_request_is_a_group_of_one_and_its_versions_are_verl_s_steps(token_output: type) -> None:
    fake = FakeAsyncClient([seg(0, 2, "default"), seg(2, 3, "3"), seg(3, 5, "4")])
    client = adapter.AprilLLMServerClient(config(url="http://h:1"), client=fake)  # type: ignore[arg-type]
    client._loop = None  # the fake is not bound to a loop

    async def go() -> Any:
        client._loop = asyncio.get_running_loop()
        return await client.generate(
            "abc", prompt_ids=[5, 6], sampling_params={"logprobs": True}, priority=3
        )

    out = asyncio.run(go())
    (call,) = fake.calls
    (spec,) = call["specs"]
    assert call["target"] == 1 and call["resume_first"] is False
    assert spec["n"] == 1 and spec["input_ids"] == [5, 6]
    assert spec["sampling_params"] == {"max_new_tokens": 16}
    assert spec["group_id"].startswith("verl-abc.")
    assert out.token_ids == [0, 1, 2, 3, 4] and out.log_probs == [-1.0] * 5
    assert out.stop_reason == "completed" and out.num_preempted == 2
    assert (
        out.extra_fields["global_steps"],
        out.extra_fields["min_global_steps"],
        out.extra_fields["max_global_steps"],
    ) == (4, 3, 4)


def test_the_batch_groups_rows_by_uid() -> None:
    assert uid_blocks(["a", "a", "b", "b"], 2) == [0, 2]
    with pytest.raises(ValueError, match="groups of rollout.n"):
        uid_blocks(["a", "a", "b"], 2)
    with pytest.raises(ValueError, match="contiguously"):
        uid_blocks(["a", "b", "a", "b"], 2)


def test_rows_travel_as_json() -> None:
    np = pytest.importorskip("numpy")
    row = {
        "raw_prompt": np.array([{"role": "user", "content": "x"}], dtype=object),
        "i": np.int64(3),
    }
    assert jsonable(row) == {"raw_prompt": [{"role": "user", "content": "x"}], "i": 3}
    with pytest.raises(TypeError, match="cannot travel as JSON"):
        jsonable({"x": object()})


def test_without_verl_the_manager_names_what_to_install() -> None:
    if "verl" in sys.modules or __import__("importlib").util.find_spec("verl") is not None:
        pytest.skip("verl is installed here")
    with pytest.raises(MissingFramework, match="pip install verl==0.9.1"):
        adapter.AprilAgentLoopManager  # noqa: B018

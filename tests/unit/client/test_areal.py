"""The AReaL adapter's parts that need no AReaL (`april_client.areal`, `areal_batch.py`): the
ticket batcher's quotas and answers against a fake server, the episode's sequences and versions,
the weight version added to AReaL's update requests, and the error when AReaL is missing.
AReaL's own code is driven by tests/peers/test_areal_e2e.py (`make test-peers`)."""

from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import dataclass, field
from typing import Any

import pytest

from april_client import areal as adapter
from april_client._framework import MissingFramework
from april_client.areal_batch import Ticket, TicketBatcher, sampling_params
from april_client.protocol import Appended, Group, RolloutResp, RolloutStats, Sample, Segment


def stats() -> RolloutStats:
    return RolloutStats(
        wall_s=0.0,
        weight_version="2",
        num_finished_groups=0,
        num_buffered_groups=0,
        output_tokens=0,
        offpolicy_tokens=0,
        resumed_samples=0,
        restored_kv_tokens=0,
        recomputed_tokens=0,
    )


class FakeServer:
    """Holds the groups handed in; a call returns `target` of them, oldest first."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.calls: list[tuple[list[str], int]] = []

    def __call__(self, specs: list[dict[str, Any]], target: int) -> RolloutResp:
        self.held += [s["group_id"] for s in specs]
        self.calls.append(([s["group_id"] for s in specs], target))
        out, self.held = self.held[:target], self.held[target:]
        return RolloutResp(
            batch_id="b",
            groups=[Group(group_id=g, samples=[]) for g in out],
            buffered_group_ids=list(self.held),
            stats=stats(),
        )


def test_each_call_answers_its_quota_of_the_oldest_tickets() -> None:
    server = FakeServer()
    batcher = TicketBatcher(server, over_provision=2.0)

    async def go() -> list[str]:
        loop = asyncio.get_running_loop()
        tickets = [Ticket(None, {"group_id": f"g{i}"}, 1, loop.create_future()) for i in range(5)]
        for t in tickets:
            batcher.submit(t)
        return [(await t.answer).group_id for t in tickets]

    answers = asyncio.run(go())
    # quotas ceil(5/2)=3, then ceil(2/2)=1, then 1: every call answers at least one ticket
    assert [target for _, target in server.calls] == [3, 1, 1]
    assert server.calls[0][0] == [f"g{i}" for i in range(5)]
    assert answers == [f"g{i}" for i in range(5)]  # oldest first
    assert server.held == [] and [r["waiting"] for r in batcher.records] == [5, 2, 1]


def test_a_failed_call_reaches_every_waiting_episode() -> None:
    def broken(specs: list[dict[str, Any]], target: int) -> RolloutResp:
        raise RuntimeError("server down")

    batcher = TicketBatcher(broken)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        t = Ticket(None, {"group_id": "g"}, 1, loop.create_future())
        batcher.submit(t)
        await t.answer

    with pytest.raises(RuntimeError, match="server down"):
        asyncio.run(go())


def test_over_provision_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="over_provision"):
        TicketBatcher(FakeServer(), over_provision=0.5)


def test_an_episode_holds_the_response_in_context_order_with_areal_s_versions() -> None:
    s = Sample(
        sample_id="g/0",
        group_id="g",
        index=0,
        status="completed",
        prompt_ids=[1, 2],
        output_ids=[10, 11, 12],
        output_logprobs=[-0.1, -0.2, -0.3],
        segments=[
            Segment(start=0, end=1, weight_version="default", kv="fresh"),
            Segment(start=1, end=3, weight_version="5", kv="restored"),
        ],
        max_new_tokens=8,
        finish_reason="stop",
        appended=[Appended(at=1, ids=[90, 91])],
    )
    out = adapter.episode_lists(s, "5", "keep", initial=4)
    assert out["input_ids"] == [1, 2, 10, 90, 91, 11, 12]
    assert out["loss_mask"] == [0, 0, 1, 0, 0, 1, 1]
    assert out["logprobs"] == [0.0, 0.0, -0.1, 0.0, 0.0, -0.2, -0.3]
    assert out["versions"] == [-1, -1, 4, -1, -1, 5, 5]
    assert adapter.episode_lists(s, "5", "mask", initial=4)["loss_mask"] == [0, 0, 0, 0, 0, 1, 1]


@dataclass
class Req:
    endpoint: str
    payload: dict[str, Any]


@dataclass
class Reqs:
    requests: list[Req] = field(default_factory=list)


class FakeBackend:
    def build_disk_weight_update_requests(self, meta: Any) -> Reqs:
        return Reqs([Req("/update_weights_from_disk", {"model_path": meta.path})])

    def build_distributed_weight_update_requests(self, meta: Any, specs: Any) -> Reqs:
        return Reqs([Req("/update_weights_from_distributed", {"names": specs})])


def test_areal_s_update_requests_carry_the_weight_version() -> None:
    backend = FakeBackend()
    engine = type("Engine", (), {"_engine": type("Inner", (), {"backend": backend})()})()
    assert adapter.install_weight_versions(engine) and adapter.install_weight_versions(engine)
    meta = type("Meta", (), {"path": "/w", "version": 7})()
    disk = backend.build_disk_weight_update_requests(meta)
    assert disk.requests[0].payload == {"model_path": "/w", "weight_version": "7"}
    dist = backend.build_distributed_weight_update_requests(meta, ["a"])
    assert dist.requests[0].payload["weight_version"] == "7"
    unversioned = type("Meta", (), {"path": "/w", "version": None})()
    assert (
        "weight_version"
        not in backend.build_disk_weight_update_requests(unversioned).requests[0].payload
    )


def test_sampling_params_follow_areal_s_sglang_backend() -> None:
    g = type(
        "G",
        (),
        dict(
            top_p=0.9,
            top_k=5,
            max_new_tokens=10,
            max_tokens=12,
            greedy=True,
            temperature=0.7,
            stop_token_ids=[2],
            ignore_eos=False,
            skip_special_tokens=True,
            frequency_penalty=0.0,
            stop=["</a>"],
        ),
    )()
    p = sampling_params(g, prompt_len=4)
    assert p["max_new_tokens"] == 8 and p["temperature"] == 0.0 and p["stop"] == ["</a>"]
    with pytest.raises(ValueError, match="no room"):
        sampling_params(g, prompt_len=12)


def test_without_areal_the_workflow_names_what_to_install() -> None:
    if importlib.util.find_spec("areal") is not None:
        pytest.skip("AReaL is installed here")
    with pytest.raises(MissingFramework, match="pip install areal==1.0.4"):
        adapter.AprilWorkflow  # noqa: B018

"""The slime adapter (`april_client.slime`, `slime_samples.py`) against fakes: a stand-in for
slime's modules (its `Sample` with the fields the adapter fills, its output type, reward hub,
loader, async runner) and a fake server client. slime's own code is driven by
tests/e2e/test_slime_e2e.py."""

from __future__ import annotations

import asyncio
import enum
import sys
import types
from argparse import Namespace
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from april_client import slime as adapter
from april_client.protocol import Appended, Group, RolloutResp, RolloutStats, Sample, Segment
from april_client.slime_samples import group_metadata, rebuild_members


@dataclass
class FakeSample:
    """The fields of slime's `Sample` (slime/utils/types.py) the adapter reads and fills."""

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: Any = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: Any = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    custom_rm_path: str | None = None
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)


@dataclass
class FakeOutput:
    samples: Any
    metrics: Any = None


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 50 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


@pytest.fixture()
def fake_slime() -> Iterator[dict[str, list[Any]]]:
    """slime's modules as the adapter imports them; `calls` records what they were asked."""
    calls: dict[str, list[Any]] = {"rm": [], "eval": []}

    async def async_rm(args: Any, sample: Any) -> float:
        calls["rm"].append(sample)
        return 1.0 if sample.label == "good" else 0.0

    async def batched_async_rm(args: Any, samples: list[Any]) -> list[float]:
        return [float(len(samples))] * len(samples)

    def stock_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool) -> str:
        calls["eval"].append((rollout_id, evaluation))
        return "stock eval"

    mods = {
        "slime": {},
        "slime.utils": {},
        "slime.rollout": {},
        "slime.utils.types": {"Sample": FakeSample},
        "slime.rollout.base_types": {"RolloutFnTrainOutput": FakeOutput},
        "slime.utils.misc": {"load_function": lambda path: None},
        "slime.utils.processing_utils": {"load_tokenizer": lambda *a, **k: FakeTokenizer()},
        "slime.rollout.rm_hub": {"async_rm": async_rm, "batched_async_rm": batched_async_rm},
        "slime.utils.async_utils": {"run": asyncio.run},
        "slime.rollout.sglang_rollout": {"generate_rollout": stock_rollout},
    }
    saved = {name: sys.modules.get(name) for name in mods}
    for name, attrs in mods.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
    adapter.runs().clear()
    yield calls
    adapter.runs().clear()
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod


def member(gid: str, index: int, cuts: list[tuple[int, str]], appended: int = 0) -> Sample:
    segs, start = [], 0
    for end, version in cuts:
        segs.append(Segment(start=start, end=end, weight_version=version, kv="fresh"))
        start = end
    app = [Appended(at=1, ids=[90] * appended)] if appended else []
    return Sample(
        sample_id=f"{gid}/{index}",
        group_id=gid,
        index=index,
        status="completed" if index == 0 else "truncated",
        prompt_ids=[1, 2],
        output_ids=list(range(10, 10 + start)),
        output_logprobs=[-0.25] * start,
        segments=segs,
        max_new_tokens=8,
        finish_reason="stop",
        appended=app,
    )


class FakeClient:
    """The server's side: holds `buffered` groups; a call returns the specs' groups (finished
    under `version`), buffered ones first, `target` of them."""

    def __init__(self, buffered: list[Group], version: str = "3") -> None:
        self.buffered = buffered
        self.version = version
        self.calls: list[dict[str, Any]] = []

    def stats(self) -> dict[str, Any]:
        return {"buffered_groups": len(self.buffered)}

    def rollout(self, specs: list[dict[str, Any]], target: int, **kw: Any) -> RolloutResp:
        self.calls.append({"specs": specs, "target": target, **kw})
        fresh = [
            Group(
                group_id=s["group_id"],
                samples=[member(s["group_id"], i, [(3, self.version)]) for i in range(s["n"])],
                metadata=s["metadata"],
            )
            for s in specs
        ]
        pool = self.buffered + fresh
        out, self.buffered = pool[:target], pool[target:]
        return RolloutResp(
            batch_id="b-1",
            groups=out,
            buffered_group_ids=[g.group_id for g in self.buffered],
            stats=RolloutStats(
                wall_s=0.1,
                weight_version=self.version,
                num_finished_groups=len(out),
                num_buffered_groups=len(self.buffered),
                output_tokens=0,
                offpolicy_tokens=0,
                resumed_samples=0,
                restored_kv_tokens=0,
                recomputed_tokens=0,
            ),
        )


class FakeDataSource:
    def __init__(self, n: int) -> None:
        self.n, self.groups = n, 0

    def get_samples(self, k: int) -> list[list[FakeSample]]:
        out = []
        for _ in range(k):
            g = self.groups
            self.groups += 1
            out.append(
                [
                    FakeSample(group_index=g, index=g * self.n + i, prompt=f"q{g}", label="good")
                    for i in range(self.n)
                ]
            )
        return out


def args(**over: Any) -> Namespace:
    base = dict(
        rollout_batch_size=2,
        over_sampling_batch_size=4,
        n_samples_per_prompt=2,
        sglang_router_ip="127.0.0.1",
        sglang_router_port=1,
        hf_checkpoint="tok",
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_max_response_len=8,
        rollout_stop=None,
        rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=False,
        group_rm=False,
        rollout_sample_filter_path=None,
        rollout_all_samples_process_path=None,
        rollout_seed=42,
        sglang_enable_deterministic_inference=False,
    )
    base.update(over)
    return Namespace(**base)


def install(client: FakeClient, a: Namespace) -> adapter.SlimeRun:
    run = adapter.SlimeRun(adapter.server_url(a), client)  # type: ignore[arg-type]
    adapter.runs()[run.url] = run
    return run


def test_a_rollout_is_one_call_over_the_server_pool(fake_slime: dict[str, list[Any]]) -> None:
    a = args(sglang_enable_deterministic_inference=True)
    client = FakeClient([])
    install(client, a)
    out = adapter.generate_rollout(a, 0, FakeDataSource(2))
    (call,) = client.calls
    assert call["target"] == 2 and len(call["specs"]) == 4  # over-sampling 4, nothing buffered
    assert call["on_quota"] == "snapshot" and call["resume_first"] is True
    spec = call["specs"][0]
    assert (
        spec["seed"] == 42 and spec["n"] == 2 and spec["input_ids"] == FakeTokenizer().encode("q0")
    )
    assert spec["sampling_params"] == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 8,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    assert isinstance(out, FakeOutput) and len(out.samples) == 2
    for group in out.samples:
        assert [s.index for s in group] == [group[0].group_index * 2, group[0].group_index * 2 + 1]
        for s in group:
            assert s.tokens == [1, 2, 10, 11, 12] and s.response_length == 3
            assert s.rollout_log_probs == [-0.25] * 3 and s.loss_mask == [1, 1, 1]
            assert s.weight_versions == ["3"] and s.reward == 1.0
            assert s.response == "10 11 12"
            assert s.metadata["april_group_id"] in {c["group_id"] for c in call["specs"]}
    statuses = [s.status for s in out.samples[0]]
    assert statuses == [FakeSample.Status.COMPLETED, FakeSample.Status.TRUNCATED]
    assert len(fake_slime["rm"]) == 4


def test_buffered_groups_count_toward_over_sampling_and_come_back_marked(
    fake_slime: dict[str, list[Any]],
) -> None:
    a = args(mask_offpolicy_in_partial_rollout=True)
    first = FakeClient([])
    run = install(first, a)
    adapter.generate_rollout(a, 0, FakeDataSource(2))
    assert len(first.buffered) == 2
    # the next rollout: 2 groups still buffered, so 2 new ones; the buffered ones came from
    # rollout 0 and carry a token of an older version, which the off-policy mask zeroes
    for g in first.buffered:
        for i, s in enumerate(g.samples):
            g.samples[i] = member(g.group_id, s.index, [(1, "2"), (3, "3")])
    out = adapter.generate_rollout(a, 1, FakeDataSource(2))
    assert len(first.calls[1]["specs"]) == 2
    record = run.records[-1]
    assert record.buffered_before == 2 and len(record.carried) == 2
    carried = [g for g in out.samples if g[0].metadata.get("start_rollout_id") == 0]
    assert len(carried) == 2
    for s in carried[0]:
        assert s.loss_mask == [0, 1, 1] and s.weight_versions == ["2", "3"]


def test_without_partial_rollout_stragglers_are_dropped(fake_slime: dict[str, list[Any]]) -> None:
    a = args(partial_rollout=False)
    client = FakeClient([])
    install(client, a)
    adapter.generate_rollout(a, 0, FakeDataSource(2))
    assert client.calls[0]["on_quota"] == "drop"


def test_group_rm_scores_each_group_with_slime_s_batched_hub(
    fake_slime: dict[str, list[Any]],
) -> None:
    a = args(group_rm=True)
    install(FakeClient([]), a)
    out = adapter.generate_rollout(a, 0, FakeDataSource(2))
    assert all(s.reward == 2.0 for g in out.samples for s in g)
    assert fake_slime["rm"] == []


def test_evaluation_is_slime_s_own_rollout(fake_slime: dict[str, list[Any]]) -> None:
    assert adapter.generate_rollout(args(), 5, None, evaluation=True) == "stock eval"
    assert fake_slime["eval"] == [(5, True)]


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"over_sampling_batch_size": 1}, "over-sampling-batch-size"),
        ({"custom_generate_function_path": "m.f"}, "custom-generate-function-path"),
        ({"dynamic_sampling_filter_path": "m.f"}, "dynamic-sampling-filter-path"),
        ({"n_samples_per_prompt": 0}, "n-samples-per-prompt"),
    ],
)
def test_bad_settings_are_refused_by_name(
    fake_slime: dict[str, list[Any]], over: dict[str, Any], match: str
) -> None:
    a = args(**over)
    install(FakeClient([]), a)
    with pytest.raises(ValueError, match=match):
        adapter.generate_rollout(a, 0, FakeDataSource(2))


def test_a_group_of_an_earlier_process_is_rebuilt_from_its_metadata() -> None:
    sent = [FakeSample(group_index=7, index=14 + i, prompt="p", label="L") for i in range(2)]
    sent[0].metadata = {"k": 1}
    meta = group_metadata(sent, rollout_id=3)
    group = Group(
        group_id="g", samples=[member("g", i, [(2, "1")]) for i in range(2)], metadata=meta
    )
    rebuilt = rebuild_members(FakeSample, group, originals=None)
    assert [(s.group_index, s.index, s.prompt, s.label) for s in rebuilt] == [
        (7, 14, "p", "L"),
        (7, 15, "p", "L"),
    ]
    assert rebuilt[0].metadata == {"k": 1}
    with pytest.raises(ValueError, match="not sent by april_client.slime"):
        rebuild_members(FakeSample, Group(group_id="x", samples=group.samples), None)


def test_prompt_fields_must_be_json() -> None:
    s = FakeSample(group_index=0, index=0, prompt="p")
    s.metadata = {"bad": object()}
    with pytest.raises(TypeError, match="must be JSON"):
        group_metadata([s], 0)


def test_tool_answers_are_in_the_response_with_loss_mask_zero() -> None:
    from april_client.slime_samples import fill_member

    out = FakeSample()
    s = member("g", 0, [(3, "1")], appended=2)
    fill_member(out, s, current_version="1", mask_offpolicy=False, decode=lambda ids: "")
    assert out.tokens == [1, 2, 10, 90, 90, 11, 12]
    assert out.loss_mask == [1, 0, 0, 1, 1]
    assert out.rollout_log_probs == [-0.25, 0.0, 0.0, -0.25, -0.25]


def test_without_slime_the_rollout_names_what_to_install() -> None:
    import importlib.util

    from april_client._framework import MissingFramework

    if importlib.util.find_spec("slime") is not None:
        pytest.skip("slime is importable here")
    with pytest.raises(MissingFramework, match="github.com/THUDM/slime"):
        adapter.generate_rollout(args(), 0, FakeDataSource(2))


def test_sampling_masks_fill_slime_s_top_p_replay_fields() -> None:
    from array import array

    from april_client.protocol import SamplingMask
    from april_client.slime_samples import fill_member

    out = FakeSample()
    s = member("g", 0, [(3, "1")], appended=2)
    rows = [[10, 40], [3, 11], [12]]
    s.sampling_mask = SamplingMask(
        dtype="uint16",
        ids=array("H", [i for r in rows for i in r]).tobytes(),
        counts=array("H", [len(r) for r in rows]).tobytes(),
        logprobs=[-0.1, -0.2, 0.0],
    )
    out.rollout_top_p_token_ids = out.rollout_top_p_token_offsets = None  # type: ignore[attr-defined]
    fill_member(out, s, current_version="1", mask_offpolicy=False, decode=lambda ids: "")
    # response = 10, 90, 90, 11, 12: the tool's two tokens get empty spans
    assert out.rollout_top_p_token_ids == [10, 40, 3, 11, 12]  # type: ignore[attr-defined]
    assert out.rollout_top_p_token_offsets == [0, 2, 2, 2, 4, 5]  # type: ignore[attr-defined]


def test_top_p_asks_for_masks_with_a_finite_top_k(fake_slime: dict[str, list[Any]]) -> None:
    a = args(rollout_top_p=0.9)
    client = FakeClient([])
    run = install(client, a)
    run.tokenizer = type("Tok", (FakeTokenizer,), {"__len__": lambda self: 448})()
    adapter.generate_rollout(a, 0, FakeDataSource(2))
    call = client.calls[0]
    assert call["return_sampling_mask"] is True
    assert call["specs"][0]["sampling_params"]["top_k"] == 448
    assert adapter.sampling_params(args())["top_k"] == -1  # without top-p: slime's own top_k

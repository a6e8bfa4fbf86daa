"""slime drives a live april-server through `april_client.slime.generate_rollout` (`slime.py`).

slime's own code, pinned at ../shared/peers/slime (or `$APRIL_PEERS_DIR/slime`; skipped with
the reason when that folder is absent): its `Sample`, its `RolloutDataSourceWithBuffer` over a
jsonl dataset, its `call_rollout_fn` and `RolloutFnTrainOutput`, its reward hub (through
`--custom-rm-path`), its async loop. As slime's own CPU tests do, `ray` and `sglang_router` are
stub modules (and `pylatexenc`, which its math reward imports, where it is not installed);
everything the rollout path runs is real.

Several rollouts with a weight push before each (from disk, `weight_version` = the rollout id,
as slime's engines send it), over-sampling 2x with `--partial-rollout`, then:
- each rollout returns exactly `rollout_batch_size` groups of `n_samples_per_prompt`;
- groups unfinished at a rollout's quota stay on the server and come back in a later rollout
  (metadata `start_rollout_id`, as slime marks its partials), continued, never lost or doubled:
  every group sent was returned once or is still on the server at the end;
- every field equals the server's own answer (tokens = prompt + output, logprobs, weight
  versions per segment, status), `--mask-offpolicy-in-partial-rollout` zeroes exactly the tokens
  of older versions, each sample's reward was computed from its own row (the prompt names its
  label);
- a bad setting (`--over-sampling-batch-size` below `--rollout-batch-size`) is refused with a
  message naming both;
- with `--rollout-top-p` below 1 every sample carries slime's top-p replay fields, filled from
  the server's sampling masks, which slime's own length check accepts, each sampled token in
  its kept set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from april_client import AprilClient
from april_server.models import ensure_tiny_model
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
# ../shared/peers beside the checkout (APRIL_PEERS_DIR names another place, e.g. a worktree's)
SLIME = Path(os.environ.get("APRIL_PEERS_DIR", ROOT.parent / "shared" / "peers")) / "slime"
if not (SLIME / "slime").is_dir():
    pytest.skip(f"slime's source is not at {SLIME} (see shared/peers)", allow_module_level=True)

STUBBED = ["ray", "sglang_router", "pylatexenc", "pylatexenc.latex2text"]
ROLLOUTS = 4
BATCH, OVER, N = 2, 4, 2
PROMPTS = 24
# Greedy answers that stop at two of the tiny model's common tokens: each prompt's answer has
# its own length (the first four prompts' stop after 23, 1, 9 and 30 tokens), so a rollout's
# quota is met while some of its groups are still generating: they are partials, carried to a
# later rollout. Greedy, so their lengths do not depend on chance.
STOP_IDS = [370, 380]


@pytest.fixture(scope="module")
def slime_modules() -> Iterator[None]:
    """slime importable: its folder on sys.path, stubs for what its CPU tests stub."""
    saved = {m: sys.modules.get(m) for m in STUBBED}
    stubs = ["ray", "sglang_router"]
    if importlib.util.find_spec("pylatexenc") is None:
        stubs += ["pylatexenc", "pylatexenc.latex2text"]
    for m in stubs:
        sys.modules[m] = types.ModuleType(m)
    if "pylatexenc.latex2text" in stubs:
        latex = sys.modules["pylatexenc"]
        latex.latex2text = sys.modules["pylatexenc.latex2text"]  # type: ignore[attr-defined]
    sys.path.insert(0, str(SLIME))
    yield
    sys.path.remove(str(SLIME))
    for m, mod in saved.items():
        if mod is None:
            sys.modules.pop(m, None)
        else:
            sys.modules[m] = mod


async def reward(args: Any, sample: Any) -> float:
    """`--custom-rm-path`: 1.0 when the sample's label is the one its own prompt names."""
    return 1.0 if sample.prompt.endswith(f"label {sample.label}:") else 0.0


def slime_args(url: str, data: Path, save: Path, **over: Any) -> Namespace:
    host, port = url.removeprefix("http://").split(":")
    args = dict(
        rollout_batch_size=BATCH,
        over_sampling_batch_size=OVER,
        n_samples_per_prompt=N,
        rollout_global_dataset=True,
        prompt_data=str(data),
        input_key="text",
        label_key="label",
        metadata_key="metadata",
        multimodal_keys=None,
        tool_key=None,
        apply_chat_template=False,
        apply_chat_template_kwargs=None,
        rollout_max_prompt_len=None,
        rollout_seed=42,
        rollout_shuffle=False,
        hf_checkpoint=str(ensure_tiny_model()),
        dump_details=None,
        buffer_filter_path=None,
        save=str(save),
        load=None,
        sglang_router_ip=host,
        sglang_router_port=int(port),
        rollout_temperature=0.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_max_response_len=40,
        rollout_stop=None,
        rollout_stop_token_ids=STOP_IDS,
        rollout_skip_special_tokens=False,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True,
        custom_rm_path=f"{__name__}.reward",
        rm_type=None,
        group_rm=False,
        reward_key=None,
        rollout_sample_filter_path=None,
        rollout_all_samples_process_path=None,
        custom_generate_function_path=None,
        dynamic_sampling_filter_path=None,
        use_rollout_routing_replay=False,
        sglang_enable_deterministic_inference=False,
        april_max_inflight_groups=OVER,
    )
    args.update(over)
    return Namespace(**args)


def write_dataset(path: Path) -> None:
    with path.open("w") as f:
        for i in range(PROMPTS):
            row = {"text": f"Task {i}: answer with label {i % 7}:", "label": str(i % 7)}
            f.write(json.dumps({**row, "metadata": {"row": i}}) + "\n")


def test_slime_rollouts_on_april_server(
    slime_modules: None, weights_server: ServerProc, tmp_path: Path
) -> None:
    from slime.rollout.data_source import RolloutDataSourceWithBuffer

    from april_client import slime as adapter

    write_dataset(tmp_path / "data.jsonl")
    args = slime_args(weights_server.url, tmp_path / "data.jsonl", tmp_path / "save")
    data_source = RolloutDataSourceWithBuffer(args)
    client = AprilClient(weights_server.url, timeout=120)
    assert client.stats()["buffered_groups"] == 0
    try:
        drive(adapter, args, data_source, client, weights_server.url, tmp_path)
    finally:  # the server is shared with later tests: leave nothing of this run on it
        for g in client.partials():
            client.delete_partial(g.group_id)


def drive(
    adapter: Any, args: Namespace, data_source: Any, client: AprilClient, url: str, tmp: Path
) -> None:
    from slime.rollout.base_types import RolloutFnTrainOutput, call_rollout_fn
    from slime.utils.types import Sample

    tiny = str(ensure_tiny_model())

    returned: dict[str, int] = {}
    sent: dict[str, int] = {}  # group id -> the rollout that sent it
    multi_segment = 0
    for rollout_id in range(ROLLOUTS):
        # slime's weight update before each rollout (its first one too), with its version
        pushed = client.update_weights_from_disk(tiny, weight_version=str(rollout_id))
        assert pushed["success"], pushed
        out = call_rollout_fn(
            adapter.generate_rollout, args, rollout_id, data_source, evaluation=False
        )
        assert isinstance(out, RolloutFnTrainOutput)
        run = adapter.runs()[url]
        record, resp = run.records[-1], run.last_response
        assert resp is not None and resp.stats.weight_version == str(rollout_id)
        print(
            f"rollout {rollout_id}: returned {len(out.samples)} groups x {N} "
            f"(carried from earlier rollouts: {len(record.carried)}), sent {len(record.sent)} "
            f"new, server held {record.buffered_before} before and {len(record.buffered_after)} "
            f"after, weight version {record.weight_version}"
        )
        assert len(out.samples) == BATCH and all(len(g) == N for g in out.samples)
        assert len(record.sent) == max(0, OVER - record.buffered_before)
        sent.update(dict.fromkeys(record.sent, rollout_id))
        by_id = {g.group_id: g for g in resp.groups}
        for group in out.samples:
            gid = group[0].metadata["april_group_id"]
            assert gid not in returned, f"{gid} returned twice"
            returned[gid] = rollout_id
            server = by_id[gid]
            assert ("start_rollout_id" in group[0].metadata) == (gid in record.carried)
            for s, ss in zip(group, sorted(server.samples, key=lambda x: x.index), strict=True):
                assert isinstance(s, Sample) and s.prompt.endswith(f"label {s.label}:")
                assert s.tokens == ss.prompt_ids + ss.output_ids
                assert s.response_length == len(ss.output_ids)
                assert s.rollout_log_probs == ss.output_logprobs
                assert s.weight_versions == [seg.weight_version for seg in ss.segments]
                assert s.status.value == ss.status
                assert s.reward == 1.0
                fresh = [
                    int(seg.weight_version == str(rollout_id))
                    for seg in ss.segments
                    for _ in range(seg.start, seg.end)
                ]
                assert s.loss_mask == fresh
                multi_segment += len(ss.segments) > 1
        assert sorted(g[0].index for g in out.samples) == [g[0].index for g in out.samples]
    left = {g.group_id for g in client.partials()}
    assert set(returned) | left == set(sent) and not set(returned) & left, "a group was lost"
    carried = [gid for gid, r in returned.items() if r > sent[gid]]
    print(
        f"{len(carried)} groups came back in a later rollout; {multi_segment} samples ran in "
        f"more than one segment; {len(left)} groups left on the server"
    )
    assert carried, "no group was carried from one rollout to a later one"
    assert multi_segment, "no sample was continued across calls"

    with pytest.raises(ValueError, match="over-sampling-batch-size.*rollout-batch-size"):
        bad = slime_args(url, tmp / "data.jsonl", tmp / "s")
        bad.over_sampling_batch_size = 1
        adapter.generate_rollout(bad, ROLLOUTS, data_source)

    # Top-p replay: slime asks for kept sets when its top-p is below 1; the adapter asks the
    # server for sampling masks and fills slime's replay fields, which slime's own check accepts.
    # (New groups only: the greedy rollouts' leftovers, generated without masks, go first.)
    for gid in left:
        client.delete_partial(gid)
    args.rollout_top_p, args.rollout_temperature = 0.9, 1.0
    out = adapter.generate_rollout(args, ROLLOUTS + 1, data_source)
    rows = 0
    for group in out.samples:
        for s in group:
            s._validate_response_metadata_lengths()  # slime's own length checks
            ids, offsets = s.rollout_top_p_token_ids, s.rollout_top_p_token_offsets
            assert len(offsets) == s.response_length + 1
            prompt = len(s.tokens) - s.response_length
            for j, token in enumerate(s.tokens[prompt:]):
                assert token in ids[offsets[j] : offsets[j + 1]]
            rows += s.response_length
    print(f"top-p replay: {rows} kept sets, {len(ids) / max(1, len(offsets) - 1):.1f} ids a row")

"""AReaL 1.0.4 drives a live april-server (`april_client.areal`, `areal_batch.py`).

Runs in AReaL's own venv (`make test-peers`: scripts/peer-venv.sh areal), against a server from
the server's venv. AReaL's own code throughout: its `RemoteSGLangEngine` pointed at the server
(its health wait, its `WorkflowExecutor` thread), `prepare_batch` over a `StatefulDataLoader`
with `group_size = gconfig.n_samples` (its `GroupedRolloutWorkflow`), its staleness manager, its
weight update from disk (`update_weights_from_disk` after the trainer's name_resolve record, then
`set_version`), the workflow named by its string path as a trainer names it.

Several steps, each as AReaL's trainer makes it (a batch, then a weight push of the next
version), over-provisioning 2, then:
- each step returns exactly `batch_size` groups of `n` (AReaL's count), and every call of the
  workflow returned exactly its quota;
- groups handed in by one call came back in a later one (carried on the server), none lost or
  doubled: every group sent was returned once, or is still on the server at the end;
- every episode equals the server's answer (tokens, logprobs, per-token versions: AReaL's
  version numbers, which its updates now carry to the server), and its reward was computed from
  its own group's row;
- a tool turn: a second workflow with `tool`/`turns` answers each turn; the answers are in the
  episode with loss mask 0;
- a bad setting (over-provisioning below 1) is refused with a message naming it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.peers.peer_server import peer_server, tiny_model_path
from tests.server_proc import ServerProc

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.peers,
    pytest.mark.filterwarnings("ignore::Warning"),
]

STEPS = 3
BATCH, N = 2, 2
PROMPTS = 16
WORKFLOW = "april_client.areal.AprilWorkflow"
# Long enough that a step's calls may outlast AReaL's one-second wait between submissions: it
# then submits the next prompts while this step's run, and what a step does not take is carried
# to the next step (counted and printed; whether it happens depends on timing).
MAX_NEW = 160


def reward(prompt: str, completion: str, prompt_ids: Any, completion_ids: Any, **row: Any) -> float:
    """AReaL's reward function: the row's own number, so the test sees which row scored it;
    the row must be the one whose prompt this is."""
    assert f"Task {row['row']}:" in prompt, (row, prompt)
    return float(row["row"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    pytest.importorskip("areal", reason="runs in AReaL's own venv: make test-peers")
    yield from peer_server(tmp_path_factory.mktemp("areal-april-state"))


def rows() -> list[dict[str, Any]]:
    return [
        {"messages": [{"role": "user", "content": f"Task {i}: say {i % 5}."}], "row": i}
        for i in range(PROMPTS)
    ]


def engine_for(url: str, tmp: Path) -> Any:
    from areal.api.cli_args import InferenceEngineConfig, NameResolveConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.utils import name_resolve

    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp / "names")))
    config = InferenceEngineConfig(
        experiment_name="april",
        trial_name="e2e",
        consumer_batch_size=BATCH,
        max_concurrent_rollouts=2 * BATCH,
        max_head_offpolicyness=1,
        setup_timeout=120,
        request_timeout=600,
    )
    engine = RemoteSGLangEngine(config)
    engine.initialize(addr=url.removeprefix("http://"), train_data_parallel_size=1)
    return engine


def push(engine: Any, model: str, tmp: Path, version: int) -> None:
    """AReaL's disk update: the trainer saves the weights and records it in name_resolve, the
    rollout engine loads them, then every engine takes the new version."""
    from areal.api.io_struct import WeightUpdateMeta
    from areal.utils import name_resolve, names

    meta = WeightUpdateMeta(type="disk", path=str(tmp / "weights" / "weight_update"))
    meta = meta.with_version(version)
    shutil.copytree(model, meta.path, dirs_exist_ok=True)  # "saved" by the trainer
    key = names.update_weights_from_disk("april", "e2e", engine.get_version())
    name_resolve.add(key, str(time.time()), replace=True)
    engine.update_weights_from_disk(meta).result(timeout=300)
    engine.set_version(version)


def gconfig() -> Any:
    from areal.api.cli_args import GenerationHyperparameters

    return GenerationHyperparameters(
        n_samples=N, max_new_tokens=MAX_NEW, max_tokens=512, greedy=True
    )


def check_episode(traj: dict[str, Any], sample: Any, row: int) -> None:
    ids = traj["input_ids"][0].tolist()
    p = len(sample.prompt_ids)
    assert ids == sample.prompt_ids + sample.output_ids
    assert traj["logprobs"][0][p:].tolist() == pytest.approx(sample.output_logprobs, abs=1e-6)
    assert traj["loss_mask"][0].tolist() == [0] * p + [1] * len(sample.output_ids)
    versions = [  # AReaL's numbers; the start-up weights (`default`) are its version 0
        int(seg.weight_version) if seg.weight_version.isdigit() else 0
        for seg in sample.segments
        for _ in range(seg.start, seg.end)
    ]
    assert traj["versions"][0].tolist() == [-1] * p + versions
    assert float(traj["rewards"][0]) == float(row)


def matching(groups: list[Any], traj: dict[str, Any], member: int) -> tuple[Any, Any]:
    """The returned group whose `member`-th sample's tokens this episode row holds (AReaL
    concatenates a group's episodes in member order)."""
    ids = traj["input_ids"][0].tolist()
    for g in groups:
        s = sorted(g.samples, key=lambda x: x.index)[member]
        if s.prompt_ids + s.response_ids == ids:
            return g, s
    raise AssertionError("an episode matches no group the server returned")


def idle() -> Any:
    class Done:
        def done(self) -> bool:
            return True

    return Done()


def tool(call: Any) -> str:
    """A tool for the agent turn: answers every turn with the same short text."""
    return " ok"


def test_areal_workflow_batches_on_april_server(server: ServerProc, tmp_path: Path) -> None:
    from areal.api.workflow_api import RolloutWorkflow
    from areal.utils.dynamic_import import import_from_string
    from torchdata.stateful_dataloader import StatefulDataLoader

    from april_client import AprilClient

    model = tiny_model_path()
    cls = import_from_string(WORKFLOW)  # as AReaL resolves a workflow named by its path
    assert issubclass(cls, RolloutWorkflow)
    workflow = cls(reward_fn=reward, gconfig=gconfig(), tokenizer=model, over_provision=2.0)
    engine = engine_for(server.url, tmp_path)
    loader = StatefulDataLoader(rows(), batch_size=BATCH, shuffle=False, collate_fn=lambda x: x)
    client = AprilClient(server.url, timeout=120)
    groups: dict[str, Any] = {}
    step_of_call: list[int] = []
    try:
        for step in range(STEPS):
            seen = len(workflow.batcher.records)
            batch = engine.prepare_batch(loader, workflow=workflow, group_size=N)
            records = workflow.batcher.records[seen:]
            step_of_call += [step] * len(records)
            for r in records:
                groups.update({g.group_id: g for g in r["groups"]})
                assert len(r["returned"]) == r["target"], r
            print(
                f"step {step}: {len(batch)} groups x {N} episodes (asked {BATCH}); workflow calls "
                + "; ".join(
                    f"quota {r['target']} of {r['waiting']} waiting, sent {len(r['sent'])}, "
                    f"carried {len(r['carried'])}, left {len(r['buffered'])}"
                    for r in records
                )
            )
            assert len(batch) == BATCH and all(t["input_ids"].shape[0] == N for t in batch)
            for traj in batch:
                for i in range(N):
                    one = {k: v[i : i + 1] for k, v in traj.items()}
                    g, s = matching(list(groups.values()), one, i)
                    check_episode(one, s, g.metadata["areal"]["row"])
            push(engine, model, tmp_path, step + 1)
        # AReaL's episodes submitted ahead of the last step finish in the background: wait for
        # the workflow's calls to answer them all before counting
        deadline = time.monotonic() + 300
        while workflow.batcher.waiting or not (workflow.batcher._task or idle()).done():
            assert time.monotonic() < deadline, "the workflow's calls did not finish"
            time.sleep(0.2)
        records = list(workflow.batcher.records)
        step_of_call += [STEPS] * (len(records) - len(step_of_call))
        sent = {gid: i for i, r in enumerate(records) for gid in r["sent"]}
        back = {gid: i for i, r in enumerate(records) for gid in r["returned"]}
        assert len(back) == sum(len(r["returned"]) for r in records), "a group came back twice"
        carried = [gid for gid, i in back.items() if i > sent[gid]]
        assert carried, "no group was carried from one call to a later one"
        across = [g for g, i in back.items() if step_of_call[i] > step_of_call[sent[g]]]
        print(f"{len(carried)} groups came back in a later call, {len(across)} at a later step")
        # The tool turn: a second engine (prepare_batch keeps its first workflow), each
        # member's turns answered by the tool.
        tooled = cls(
            reward_fn=reward,
            gconfig=gconfig(),
            tokenizer=model,
            tool=tool,
            turns={"stop_token_ids": [370, 380], "max_turns": 2},
        )
        tool_engine = engine_for(server.url, tmp_path)
        try:
            tool_loader = StatefulDataLoader(
                rows(), batch_size=BATCH, shuffle=False, collate_fn=lambda x: x
            )
            out = tool_engine.prepare_batch(tool_loader, workflow=tooled, group_size=N)
        finally:
            tool_engine.destroy()
        assert len(out) == BATCH
        answers = 0
        tool_groups = [g for r in list(tooled.batcher.records) for g in r["groups"]]
        for traj in out:
            for i in range(N):
                one = {k: v[i : i + 1] for k, v in traj.items()}
                g, s = matching(tool_groups, one, i)
                p = len(s.prompt_ids)
                mask = one["loss_mask"][0][p:].tolist()
                assert mask == s.loss_mask
                answers += len(s.appended)
        print(f"tool turns: {answers} answers appended in {BATCH * N} episodes")
        assert answers, "no turn ended at a turn stop"
    finally:
        engine.destroy()
    left = {g.group_id for g in client.partials()}
    assert set(back) | left >= set(sent), "a group was lost"
    print(f"{len(carried)} groups came back in a later call; {len(left)} left on the server")
    with pytest.raises(ValueError, match="over_provision"):
        cls(reward_fn=reward, gconfig=gconfig(), tokenizer=model, over_provision=0.5)
    for gid in left:
        client.delete_partial(gid)

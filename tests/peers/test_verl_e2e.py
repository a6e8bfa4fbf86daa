"""verl 0.9.1 drives a live april-server (`april_client.verl`, `verl_batch.py`, `verl_weights.py`).

Runs in verl's own venv (`make test-peers`: scripts/peer-venv.sh verl), against a server from the
server's venv. verl's own code throughout, with no Ray cluster: its trainer config (composed
from its `ppo_trainer.yaml`), its `RLHFDataset` and `collate_fn` over a parquet file, its
`DataProto`, its `AgentLoopWorker` and single-turn agent loop (in this process), its reward
hook (`reward.custom_reward_function`), its checkpoint-engine interface for the weights.

Several steps as `RayPPOTrainer.fit` makes them (uid per prompt, the reward keys kept, the
batch repeated `rollout.n` times, `generate_sequences`, then `batch.union(output)`), a weight
push before each (verl's `send_weights(weights, global_steps)` on the `april` backend, over a
gloo group), over-provisioning 2:
- each step returns exactly the step's prompts x n rows, one returned group per n-row block;
- groups left over at a step come back at a later one, none lost or doubled (every group sent
  was returned once or is still on the server);
- every row equals the server's answer (prompt, response, rollout log-probs, response mask,
  the global steps that sampled it), its reward was computed from its own group's row, and
  verl's positional join (`union`) accepts the batch;
- a validation batch runs verl's own agent loops through `AprilLLMServerClient`, each row
  answered for its own prompt;
- a bad setting (over-provisioning below 1) is refused with a message naming it.
"""

from __future__ import annotations

import os
import uuid
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

# Under max_staleness, an "auto" call keeps no group beyond its quota in progress until 8
# samples have finished (no length evidence to weigh what it would carry over): with 4 samples
# a step, steps 0 and 1 carry nothing, and partials carried and continued need steps after.
STEPS = 5
BATCH, N = 2, 2
PROMPTS = 16


def reward(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """verl's custom reward hook: the row's own index, so the test sees which row scored it."""
    assert ground_truth == f"row-{extra_info['row']}"
    return float(extra_info["row"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    pytest.importorskip("verl", reason="runs in verl's own venv: make test-peers")
    yield from peer_server(tmp_path_factory.mktemp("verl-april-state"))


def write_parquet(path: Path) -> None:
    import pandas as pd

    rows = [
        {
            "prompt": [{"role": "user", "content": f"Task {i}: say {i % 5} and stop."}],
            "data_source": "april_test",
            "reward_model": {"ground_truth": f"row-{i}"},
            "extra_info": {"row": i},
        }
        for i in range(PROMPTS)
    ]
    pd.DataFrame(rows).to_parquet(path)


def verl_config(url: str, model: str, data: Path, **april: Any) -> Any:
    import verl
    from hydra import compose, initialize_config_dir

    settings = {"url": url, "over_provision": 2.0, "max_staleness": 2, **april}
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.prompt_length=64",
        "actor_rollout_ref.rollout.response_length=40",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.rollout.temperature=0",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "data.prompt_key=prompt",
        f"data.train_batch_size={BATCH}",
        f"reward.custom_reward_function.path={__file__}",
        "reward.custom_reward_function.name=reward",
        "+actor_rollout_ref.rollout.agent.agent_loop_manager_class="
        "april_client.verl.AprilAgentLoopManager",
        *(f"+april.{k}={v}" for k, v in settings.items()),
        # greedy answers that stop at two of the tiny model's common tokens: lengths differ by
        # prompt, so some groups are still generating at a quota (partials, carried)
        "+april.sampling.stop_token_ids=[370,380]",
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def step_batch(dataset: Any, step: int) -> tuple[Any, Any]:
    """What `RayPPOTrainer.fit` hands `generate_sequences` at a step, and its own batch."""
    import numpy as np
    from verl import DataProto
    from verl.utils.dataset.rl_dataset import collate_fn

    items = [dataset[(step * BATCH + i) % len(dataset)] for i in range(BATCH)]
    batch = DataProto.from_single_dict(collate_fn(items))
    batch.non_tensor_batch["uid"] = np.array(
        [str(uuid.uuid4()) for _ in range(BATCH)], dtype=object
    )
    keep = {"data_source", "reward_model", "extra_info", "uid"}
    gen = batch.pop(non_tensor_batch_keys=[k for k in batch.non_tensor_batch if k not in keep])
    gen.non_tensor_batch.update(batch.non_tensor_batch)
    gen.meta_info["global_steps"] = step
    return batch, gen.repeat(repeat_times=N, interleave=True)


def test_verl_agent_loop_batches_on_april_server(server: ServerProc, tmp_path: Path) -> None:
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.utils.import_utils import load_class_from_fqn

    from april_client import AprilClient
    from april_client.verl_weights import engine_class

    model_path = tiny_model_path()
    write_parquet(tmp_path / "train.parquet")
    config = verl_config(server.url, model_path, tmp_path / "train.parquet")
    fqn = config.actor_rollout_ref.rollout.agent.agent_loop_manager_class
    manager_cls = load_class_from_fqn(fqn, "AgentLoopManager")  # as RayPPOTrainer loads it
    assert issubclass(manager_cls, AgentLoopManager)
    manager = manager_cls.create(config=config, llm_client=None)
    quota = manager.april_quota
    dataset = quota.dataset(manager.worker)
    engine = engine_class()(url=server.url, mode="distributed")
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    client = AprilClient(server.url, timeout=120)

    returned: dict[str, int] = {}
    continued = 0  # samples that ran in more than one segment (cut at one step, resumed later)
    for step in range(STEPS):
        asyncio.run(engine.send_weights(model.named_parameters(), global_steps=step))
        batch, gen = step_batch(dataset, step)
        out = manager.generate_sequences(gen)
        record, resp = quota.records[-1], quota.last_response
        assert resp is not None and resp.stats.weight_version == str(step)
        print(
            f"step {step}: {len(out)} rows = {len(resp.groups)} groups x {N} (asked {BATCH}), "
            f"sent {len(record['sent'])} new groups, carried from earlier steps "
            f"{len(record['carried'])}, left on the server {len(record['buffered'])}"
        )
        assert len(out) == BATCH * N and len(resp.groups) == BATCH
        batch = batch.repeat(repeat_times=N, interleave=True).union(out)  # fit's join
        assert "rm_scores" in batch.batch.keys()
        width = out.batch["prompts"].shape[1]
        for b, group in enumerate(resp.groups):
            assert group.group_id not in returned, f"{group.group_id} returned twice"
            returned[group.group_id] = step
            row = group.metadata["verl"]
            for i, s in enumerate(sorted(group.samples, key=lambda x: x.index)):
                r = b * N + i
                mask = out.batch["attention_mask"][r]
                prompt = out.batch["prompts"][r][mask[:width].bool()].tolist()
                resp_len = int(mask[width:].sum())
                assert prompt == s.prompt_ids
                assert out.batch["responses"][r][:resp_len].tolist() == s.output_ids
                logps = out.batch["rollout_log_probs"][r][:resp_len].tolist()
                assert logps == pytest.approx(s.output_logprobs, abs=1e-6)
                assert out.batch["response_mask"][r][:resp_len].tolist() == [1] * resp_len
                steps = [int(seg.weight_version) for seg in s.segments]
                assert out.non_tensor_batch["min_global_steps"][r] == min(steps)
                assert out.non_tensor_batch["max_global_steps"][r] == max(steps)
                score = float(out.batch["rm_scores"][r].sum())
                assert score == float(row["extra_info"]["row"]), "scored against another row"
                assert out.non_tensor_batch["april_group_id"][r] == group.group_id
                continued += len(s.segments) > 1
    left = {g.group_id for g in client.partials()}
    sent = set(quota.ledger.sent)
    assert set(returned) | left == sent and not set(returned) & left, "a group was lost"
    carried = [g for g, s in returned.items() if s > quota.ledger.sent[g]]
    print(
        f"{len(carried)} groups came back at a later step, {continued} samples continued "
        f"across steps; {len(left)} groups left on the server"
    )
    assert carried, "no group was carried to a later step"
    assert continued, "no partial sample was continued at a later step"

    # Validation: verl's own agent loops, each request answered through AprilLLMServerClient.
    _, val = step_batch(dataset, STEPS)
    val.meta_info["validate"] = True
    calls = manager.april_client.calls
    vout = manager.generate_sequences(val)
    assert len(vout) == BATCH * N and manager.april_client.calls == calls + BATCH * N

    with pytest.raises(ValueError, match="over_provision"):
        manager_cls(
            config=verl_config(
                server.url, model_path, tmp_path / "train.parquet", over_provision=0.5
            )
        )
    for gid in left:
        client.delete_partial(gid)

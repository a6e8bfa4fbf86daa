"""The quota-level batch where verl makes its batch: `AprilAgentLoopManager` (for `verl.py`).

verl's trainer hands `AgentLoopManager.generate_sequences` the step's prompts, each repeated
`rollout.n` times contiguously (one `uid` per prompt), and joins the answer to its batch by
position. The manager makes that one `POST /april/v1/rollouts` call:

- each prompt becomes a group of `n` (its ids built by verl's own agent loop tokenization,
  `ct_build_initial_tokens`), with its row (`raw_prompt`, `data_source`, `reward_model`,
  `extra_info`, `index`, `uid`) as the group's metadata; with `april.over_provision = F`,
  extra prompts drawn from verl's own training set (`config.data.train_files`, through verl's
  dataset class) keep `F x` the step's groups in play (groups the server still holds from
  earlier steps count toward it: `trainer_batch.extra_groups`);
- the server answers with exactly the step's number of finished groups, buffered ones first;
  the rest stays there for the next step;
- each returned sample becomes an `AgentLoopOutput` and goes through verl's own post-processing
  (`AgentLoopWorker._agent_loop_postprocess`, `_postprocess`: padding, masks, position ids);
  its reward is verl's reward function (`reward.custom_reward_function`, else
  `default_compute_score`) on its own group's row, set as the output's `reward_score`, so the
  batch carries `rm_scores` and verl does not score it again against the positional row. Each
  block of `n` rows is one returned group, so GRPO's grouping by `uid` holds.

Validation batches and agent loops other than the single-turn one run verl's own agent loops
through `AprilLLMServerClient` (no quota: each request is answered). The worker runs in this
process (no Ray actors).
"""

from __future__ import annotations

import asyncio
import functools
import random
import uuid
from collections.abc import Sequence
from typing import Any

import msgspec

from ._framework import framework
from ._sync import AprilClient
from .protocol import Group, RolloutResp
from .trainer_batch import (
    Ledger,
    call_record,
    extra_groups,
    jsonable,
    response_logprobs,
    response_mask,
)
from .verl import (
    CALL_TIMEOUT_S,
    AprilLLMServerClient,
    AprilSettings,
    response_budget,
    settings,
    version_steps,
)

KEY = "verl"
ROW_FIELDS = ("raw_prompt", "data_source", "reward_model", "extra_info", "index", "uid")


def prompt_key(raw_prompt: Any) -> str:
    return msgspec.json.encode(jsonable(raw_prompt)).decode()


def uid_blocks(uids: Sequence[Any], n: int) -> list[int]:
    """The first row of each prompt: verl repeats each prompt `n` times contiguously."""
    if n < 1 or len(uids) % n:
        raise ValueError(f"{len(uids)} rows do not split into groups of rollout.n = {n}")
    starts = list(range(0, len(uids), n))
    for s in starts:
        if any(u != uids[s] for u in uids[s : s + n]):
            raise ValueError(
                f"rows {s}..{s + n - 1} hold more than one uid: expected each prompt repeated "
                f"{n} times contiguously (verl's repeat(interleave=True))"
            )
    return starts


def group_row(group: Group) -> dict[str, Any]:
    meta = group.metadata.get(KEY) if isinstance(group.metadata, dict) else None
    if not isinstance(meta, dict) or "raw_prompt" not in meta:
        raise ValueError(f"group {group.group_id} was not sent by april_client.verl")
    return dict(meta)


class QuotaBatch:
    """The manager's side of one run: settings, client, ledger, the training set for extras."""

    def __init__(self, config: Any, april: AprilSettings) -> None:
        self.config = config
        self.april = april
        self.client = AprilClient(april.url, timeout=CALL_TIMEOUT_S)
        self.run_id = "verl-" + uuid.uuid4().hex[:8]
        self.ledger = Ledger()
        self.calls = 0
        self.records: list[dict[str, Any]] = []
        self.last_response: RolloutResp | None = None
        self._dataset: Any = None

    def dataset(self, worker: Any) -> Any:
        if self._dataset is None:
            data = framework("verl.utils.dataset.rl_dataset")
            cls = data.get_dataset_class(self.config.data)
            self._dataset = cls(
                data_files=self.config.data.train_files,
                tokenizer=worker.tokenizer,
                config=self.config.data,
                processor=worker.processor,
            )
        return self._dataset

    def draw(self, worker: Any, count: int, exclude: set[str], step: int) -> list[dict[str, Any]]:
        """`count` rows of the training set, none with a prompt of this step's."""
        if count <= 0:
            return []
        ds = self.dataset(worker)
        rng = random.Random(f"{self.april.seed}:{self.run_id}:{step}:{self.calls}")
        order = list(range(len(ds)))
        rng.shuffle(order)
        rows = []
        for i in order:
            item = ds[i]
            if prompt_key(item.get("raw_prompt")) in exclude:
                continue
            row = {k: item.get(k) for k in ROW_FIELDS if k != "uid"}
            rows.append({**row, "uid": str(uuid.uuid4())})
            if len(rows) == count:
                break
        return rows

    def score(self, row: dict[str, Any], solution: str) -> float:
        reward = framework("verl.trainer.ppo.reward")
        fn = reward.get_custom_reward_fn(self.config)
        if fn is None:
            fn = framework("verl.utils.reward_score").default_compute_score
        gt = (row.get("reward_model") or {}).get("ground_truth")
        out = fn(
            data_source=row.get("data_source"),
            solution_str=solution,
            ground_truth=gt,
            extra_info=row.get("extra_info"),
        )
        return float(out["score"] if isinstance(out, dict) else out)


async def quota_batch(manager: Any, prompts: Any) -> Any:
    """One quota call for the step's prompts; verl's DataProto of the groups it returned."""
    agent_loop = framework("verl.experimental.agent_loop.agent_loop")
    quota: QuotaBatch = manager.april_quota
    worker = manager.worker
    rollout = manager.config.actor_rollout_ref.rollout
    n = int(rollout.n)
    nt = prompts.non_tensor_batch
    rows = [{k: v[i] for k, v in nt.items()} for i in range(len(prompts))]
    own = [rows[s] for s in uid_blocks([r["uid"] for r in rows], n)]
    step = int(prompts.meta_info.get("global_steps", quota.calls))
    outstanding = len(quota.ledger.outstanding())
    extra = extra_groups(len(own), quota.april.over_provision, outstanding)
    chosen = own + quota.draw(worker, extra, {prompt_key(r.get("raw_prompt")) for r in own}, step)
    loop = manager.tokenizing_loop()
    params = {
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": rollout.top_k,
        "repetition_penalty": 1.0,
        **quota.april.sampling,
    }
    specs: list[dict[str, Any]] = []
    for k, row in enumerate(chosen):
        ids = await loop.ct_build_initial_tokens(list(row["raw_prompt"]))
        budget = response_budget(rollout, len(ids))
        meta = {KEY: {**{f: jsonable(row.get(f)) for f in ROW_FIELDS}, "sent_at_step": step}}
        specs.append(
            {
                "group_id": f"{quota.run_id}.s{step}.c{quota.calls}.{k}",
                "n": n,
                "input_ids": [int(t) for t in ids],
                "sampling_params": {**params, "max_new_tokens": budget},
                "metadata": meta,
            }
        )
    sent = [str(s["group_id"]) for s in specs]
    quota.ledger.on_sent(sent, step)
    resp = await asyncio.to_thread(
        quota.client.rollout,
        specs,
        len(own),
        resume_first=True,
        on_quota="snapshot",
        max_staleness=quota.april.max_staleness,
        max_inflight_groups=quota.april.max_inflight_groups,
        request_id=f"{quota.run_id}.c{quota.calls}",
    )
    quota.calls += 1
    quota.last_response = resp
    quota.ledger.on_returned([g.group_id for g in resp.groups], step)
    version = resp.stats.weight_version
    outputs = []
    for group in resp.groups:
        row = group_row(group)
        for sample in sorted(group.samples, key=lambda s: s.index):
            newest, oldest, latest = version_steps(sample)
            response = sample.response_ids[: int(rollout.response_length)]
            out = agent_loop.AgentLoopOutput(
                prompt_ids=list(sample.prompt_ids),
                response_ids=response,
                response_mask=response_mask(sample, version, quota.april.stale_tokens)[
                    : len(response)
                ],
                response_logprobs=response_logprobs(sample)[: len(response)],
                num_turns=2,
                metrics=agent_loop.AgentLoopMetrics(),
                extra_fields={
                    "global_steps": newest,
                    "min_global_steps": oldest,
                    "max_global_steps": latest,
                    "turn_scores": [],
                    "tool_rewards": [],
                    "april_group_id": group.group_id,
                    "april_uid": row.get("uid"),
                },
            )
            solution = worker.tokenizer.decode(response, skip_special_tokens=True)
            out.reward_score = quota.score(row, solution)
            outputs.append(await worker._agent_loop_postprocess(out, False, **row))
    quota.records.append({"step": step, **call_record(sent, resp)})
    return worker._postprocess(outputs, input_non_tensor_batch=nt, validate=False)


@functools.cache
def manager_class() -> type:
    """verl's `AgentLoopManager` with its batch made by one quota call (module docstring)."""
    agent_loop = framework("verl.experimental.agent_loop.agent_loop")
    ray_utils = framework("verl.utils.ray_utils")

    class AprilAgentLoopManager(agent_loop.AgentLoopManager):  # type: ignore[misc,name-defined]
        def __init__(
            self,
            config: Any,
            llm_client: Any = None,
            teacher_client: Any = None,
            reward_loop_worker_handles: Any = None,
        ) -> None:
            super().__init__(config, llm_client, teacher_client, reward_loop_worker_handles)
            april = settings(config)
            self.april_client = AprilLLMServerClient(config, url=april.url)
            self.april_quota = QuotaBatch(config, april)

        async def _init_agent_loop_workers(self) -> None:
            # One worker in this process, serving every agent loop through april-server.
            self.worker = agent_loop.AgentLoopWorker(
                self.config, self.april_client, self.teacher_client, self.reward_loop_worker_handles
            )
            self.agent_loop_workers: list[Any] = []

        def tokenizing_loop(self) -> Any:
            """verl's single-turn agent loop, for its prompt tokenization (made in the running
            event loop, as verl makes one per trajectory: it keeps that loop)."""
            hydra = framework("hydra.utils")
            worker = self.worker
            return hydra.instantiate(
                agent_loop._agent_loop_registry["single_turn_agent"],
                trainer_config=agent_loop.DictConfigWrap(config=self.config),
                server_manager=self.april_client,
                tokenizer=worker.tokenizer,
                processor=worker.processor,
                hf_model_type=worker.hf_model_type,
                dataset_cls=worker.dataset_cls,
                data_config=agent_loop.DictConfigWrap(self.config.data),
                tools=agent_loop.ToolListWrap(worker.tools),
            )

        @ray_utils.auto_await  # type: ignore[untyped-decorator]
        async def generate_sequences(self, prompts: Any) -> Any:
            nt = prompts.non_tensor_batch
            default = self.config.actor_rollout_ref.rollout.agent.default_agent_loop
            names = set(nt.get("agent_name", [default]))
            single = names <= {"single_turn_agent"} and "__do_sample__" not in nt
            if prompts.meta_info.get("validate", False) or not single:
                output = await self.worker.generate_sequences(prompts)
            else:
                output = await quota_batch(self, prompts)
            timing = self._performance_metrics([output.meta_info.pop("metrics")], output)
            output.meta_info = {"timing": timing, **output.meta_info}
            return output

    return AprilAgentLoopManager

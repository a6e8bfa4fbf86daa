"""Episode tickets served by quota calls, and AReaL's `AprilWorkflow` (for `areal.py`).

`TicketBatcher` runs in the event loop AReaL runs its episodes in. A ticket is one prompt's
group (its `n` members gathered); the batcher makes one `/rollouts` call at a time: the groups
of the tickets that arrived since the last call, and a quota of `ceil(waiting / over_provision)`
groups, buffered ones first. Each returned group answers the oldest waiting ticket. Every
ticket handed in one group and every answer takes one, so the groups this workflow has on the
server are exactly the tickets still waiting: nothing is lost, and each call answers at least
one ticket, so every ticket is answered.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._framework import framework
from ._sync import AprilClient
from .areal import engine_url, episode_lists, install_weight_versions
from .protocol import Group, RolloutResp
from .trainer_batch import call_record, jsonable
from .trl_tools import Tool, ToolCalls, rollout_with_tool

KEY = "areal"
GATHER_S = 0.05  # tickets arriving within this long of each other go in one call
Call = Callable[[list[dict[str, Any]], int], RolloutResp]


@dataclass
class Ticket:
    data: Any
    spec: dict[str, Any]
    members: int
    answer: asyncio.Future[Group]


@dataclass
class TicketBatcher:
    """Serves tickets with quota calls, one at a time (module docstring)."""

    call: Call
    over_provision: float = 1.0
    waiting: collections.deque[Ticket] = field(default_factory=collections.deque)
    new: list[dict[str, Any]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        if self.over_provision < 1.0:
            raise ValueError(f"over_provision must be >= 1.0, got {self.over_provision}")

    def submit(self, ticket: Ticket) -> None:
        self.waiting.append(ticket)
        self.new.append(ticket.spec)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while self.waiting:
            await asyncio.sleep(GATHER_S)
            specs, self.new = self.new, []
            waiting = len(self.waiting)
            target = max(1, math.ceil(waiting / self.over_provision - 1e-9))
            try:
                resp = await asyncio.to_thread(self.call, specs, target)
            except Exception as exc:  # every waiting episode fails with it; the next starts anew
                for t in self.waiting:
                    if not t.answer.done():
                        t.answer.set_exception(exc)
                self.waiting.clear()
                return
            sent = sorted(s["group_id"] for s in specs)
            self.records.append(
                {
                    "waiting": waiting,
                    "target": target,
                    **call_record(sent, resp),
                    "groups": list(resp.groups),
                }
            )
            for group in resp.groups:
                self.waiting.popleft().answer.set_result(group)


def sampling_params(gconfig: Any, prompt_len: int) -> dict[str, Any]:
    """AReaL's generation config as its SGLang backend sends it (`build_generation_request`),
    with its engine's budget rule (`max_tokens` counts the prompt)."""
    params: dict[str, Any] = {
        "top_p": gconfig.top_p,
        "top_k": gconfig.top_k,
        "max_new_tokens": min(gconfig.max_tokens - prompt_len, gconfig.max_new_tokens),
        "temperature": 0.0 if gconfig.greedy else gconfig.temperature,
        "stop_token_ids": list(gconfig.stop_token_ids),
        "ignore_eos": gconfig.ignore_eos,
        "skip_special_tokens": gconfig.skip_special_tokens,
        "frequency_penalty": gconfig.frequency_penalty,
    }
    if gconfig.stop:
        params["stop"] = list(gconfig.stop)
    if params["max_new_tokens"] <= 0:
        raise ValueError(f"the prompt ({prompt_len} tokens) leaves no room under max_tokens")
    return params


@functools.cache
def workflow_class() -> type:
    """AReaL's `RolloutWorkflow` served by april-server (`areal.py` module docstring)."""
    api = framework("areal.api.workflow_api")
    rlvr = framework("areal.workflow.rlvr")
    torch = framework("torch")

    class AprilWorkflow(api.RolloutWorkflow):  # type: ignore[misc,name-defined]
        def __init__(
            self,
            reward_fn: Callable[..., Any] | str,
            gconfig: Any,
            tokenizer: Any,
            enable_thinking: bool = False,
            get_input_ids_fn: Callable[..., list[int]] | str = rlvr.default_get_input_ids_fn,
            data_extract_prompt_fn: Callable[..., Any] | str = (
                rlvr.default_data_extract_prompt_fn
            ),
            *,
            url: str | None = None,
            over_provision: float = 1.0,
            max_staleness: int | None = None,
            stale_tokens: str = "keep",
            tool: Tool | None = None,
            turns: Any = None,
        ) -> None:
            # RLVRWorkflow's own set-up: tokenizer, stop and pad ids, reward wrapper, prompts.
            self.rlvr = rlvr.RLVRWorkflow(
                reward_fn,
                gconfig,
                tokenizer,
                enable_thinking,
                get_input_ids_fn,
                data_extract_prompt_fn,
            )
            self.url = url
            self.max_staleness = max_staleness
            self.stale_tokens = stale_tokens
            if tool is not None and turns is None:
                raise ValueError("a tool needs turns: what ends a turn, e.g. {'stop': ['</call>']}")
            self.tool, self.turns, self.tool_calls = tool, turns, ToolCalls()
            self.batcher = TicketBatcher(self._call, over_provision)
            self.client: AprilClient | None = None
            self.rows: dict[str, Any] = {}  # group id -> its data row (this process's groups)
            self.answered: dict[str, int] = {}  # group id -> members answered so far
            self.forming: dict[int, list[Any]] = {}  # id(data) -> [members, ticket future]
            self.run_id = "areal-" + uuid.uuid4().hex[:8]
            self.initial_version = 0
            self.groups = 0

        # ---- the quota call (in a worker thread) --------------------------------------------

        def _call(self, specs: list[dict[str, Any]], target: int) -> RolloutResp:
            assert self.client is not None
            kw: dict[str, Any] = dict(
                resume_first=True,
                on_quota="snapshot",
                max_staleness=self.max_staleness,
                request_id=f"{self.run_id}.c{len(self.batcher.records)}",
            )
            if self.tool is None:
                return self.client.rollout(specs, target, **kw)
            meta: Mapping[str, Any] = dict(self.rows)
            return rollout_with_tool(
                self.client,
                specs,
                target,
                tool=self.tool,
                tokenizer=self.rlvr.tokenizer,
                turns=self.turns,
                metadata=meta,
                calls=self.tool_calls,
                **kw,
            )

        # ---- one episode ----------------------------------------------------------------------

        async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any]:
            if self.client is None:
                install_weight_versions(engine)
                self.initial_version = int(engine.get_version())
                self.client = AprilClient(self.url or engine_url(engine), timeout=3600.0)
            key = id(data)
            first = key not in self.forming
            if first:
                self.forming[key] = [0, asyncio.get_running_loop().create_future()]
            entry = self.forming[key]
            member = entry[0]
            entry[0] += 1
            if first:  # the group's other members (gathered with this one) join meanwhile
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                del self.forming[key]
                self.batcher.submit(self._ticket(engine, data, entry[0], entry[1]))
            group: Group = await entry[1]
            n = self.rlvr.gconfig.n_samples
            if entry[0] not in (1, n):
                raise ValueError(f"{entry[0]} episodes of one row gathered; expected 1 or {n}")
            samples = sorted(group.samples, key=lambda s: s.index)
            mine = samples if entry[0] == 1 else [samples[member]]
            row = self.rows.get(group.group_id) or (group.metadata or {}).get(KEY)
            if row is None:
                raise ValueError(f"group {group.group_id}: its data row is not known here")
            return await self._episode(mine, row, group)

        def _ticket(self, engine: Any, data: Any, members: int, answer: Any) -> Ticket:
            ids = self.rlvr.get_input_ids_fn(
                self.rlvr.data_extract_prompt_fn(data),
                self.rlvr.tokenizer,
                self.rlvr.enable_thinking,
            )
            gid = f"{self.run_id}.g{self.groups}"
            self.groups += 1
            self.rows[gid] = data
            try:
                meta: Any = {KEY: jsonable(data), "version": engine.get_version()}
            except TypeError:  # not JSON: the row stays in this process only
                meta = {"version": engine.get_version()}
            spec = {
                "group_id": gid,
                "n": self.rlvr.gconfig.n_samples,
                "input_ids": [int(t) for t in ids],
                "sampling_params": sampling_params(self.rlvr.gconfig, len(ids)),
                "metadata": meta,
            }
            return Ticket(data, spec, members, answer)

        async def _episode(self, samples: list[Any], row: Any, group: Group) -> dict[str, Any]:
            version = self.batcher.records[-1]["weight_version"] if self.batcher.records else ""
            tok = self.rlvr.tokenizer
            rows = []
            for s in samples:
                seqs = episode_lists(s, version, self.stale_tokens, self.initial_version)
                reward = await self.rlvr.async_reward_fn(
                    tok.decode(s.prompt_ids),
                    tok.decode(s.response_ids),
                    list(s.prompt_ids),
                    list(s.output_ids),
                    **row,
                )
                rows.append(
                    {
                        "input_ids": torch.tensor(seqs["input_ids"], dtype=torch.int32),
                        "loss_mask": torch.tensor(seqs["loss_mask"], dtype=torch.int32),
                        "logprobs": torch.tensor(seqs["logprobs"], dtype=torch.float32),
                        "versions": torch.tensor(seqs["versions"], dtype=torch.int32),
                        "attention_mask": torch.ones(len(seqs["input_ids"]), dtype=torch.bool),
                        "rewards": torch.tensor(float(reward), dtype=torch.float32),
                    }
                )
            done = self.answered.get(group.group_id, 0) + len(samples)
            if done >= len(group.samples):  # every member answered: the row is no longer needed
                self.rows.pop(group.group_id, None)
                self.answered.pop(group.group_id, None)
            else:
                self.answered[group.group_id] = done
            if len(rows) == 1:
                return {k: v.unsqueeze(0) for k, v in rows[0].items()}
            pad = framework("areal.utils.data").concat_padded_tensors
            out: dict[str, Any] = pad([{k: v.unsqueeze(0) for k, v in r.items()} for r in rows])
            return out

    return AprilWorkflow

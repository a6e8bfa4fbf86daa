"""TRL adapter: `GRPOTrainer(..., rollout_func=AprilRollout(client))` generates on april-server.

Install with `pip install "./clients/april_client[trl]"` (april-client's `trl` extra: the client
alone, with TRL pinned to 1.16.0; `rollout_func` is experimental there, set
`TRL_EXPERIMENTAL_SILENCE=1`). What one call does, in order:

1. Weights: once per optimizer step the trainer's model becomes weight version
   `str(global_step)`, so every segment the server returns names the step whose weights
   produced it. `weight_sync="distributed"` (the default) broadcasts the parameters over a
   torch.distributed group with the server's engines (`weight_sync.py`: gloo for a model on
   CPU, nccl on GPU; no shared storage; through an owner, one broadcast for every engine);
   `"disk"` saves the model to `weights_dir` and calls `/update_weights_from_disk` (the
   directory must be readable by the server).
2. Groups: TRL hands `P * n` prompts (each repeated `n = num_generations` times, contiguously).
   Each unique prompt becomes one group of `n`, with its dataset row as `metadata`; with
   `over_provision = F > 1` extra prompts drawn from the training set make `F * P` groups in
   play (groups already buffered count toward that, so the buffer stays bounded); with
   `size_pool=True`, as many as the server's last `stats.groups_wanted` if that is more (the
   pool it sizes from its step curve and predicted lengths: docs/api.md, Length prediction).
3. One `/rollouts` call with `target_groups = P`: the server runs buffered groups first and
   answers with exactly `P` whole groups; the rest stays in its buffer for a later step.
4. Rows: `n` per returned group, contiguous, with `prompt_ids` of the group that came back (a
   buffered group from an earlier step may return instead of a prompt just sent). Its dataset
   row's columns are returned as extra keys, so reward functions receive the `answer` (or any
   column) of the sample they score - use those kwargs, not TRL's `prompts` argument, which
   still holds the prompts the trainer sent. Two more keys per row: `april_group_id`, and
   `april_status` (`completed` at EOS/stop, `truncated` at `max_completion_length`).
5. Stale tokens: a sample resumed across a weight push holds tokens from an older step.
   `max_staleness` (sent to the server) restarts a sample from its prompt when its newest
   segment is more than that many versions old. Within the bound, `stale_tokens="mask"` (the
   default) sets `env_mask` to 0 on tokens from older versions, so they stay in the context
   but carry no loss; `"keep"` trains on them as APRIL's paper does, as if sampled now (TRL
   applies no importance correction without vLLM); `"correct"` trains on them with TRL's
   clipped ratio taken against the policy that sampled each token, from the returned
   `logprobs` (`trl_correction.py`); with TRL's default loss (PPO's clip) a stale token whose
   ratio left the clip band gets no gradient, so for mostly stale batches (`background=True`)
   pair it with `GRPOConfig(loss_type="cispo", epsilon_high=5.0)`, which keeps every token's
   gradient with a capped importance weight (docs/trainers.md, "The loss: why cispo").
   TRL's `off_policy_mask_threshold` can also use those `logprobs` to drop sequences that
   drifted too far. With top-k sampling, `sampling_mask=True` returns each token's kept set
   (docs/api.md, Sampling mask): `logprobs` are then over the kept sets, and the trainer's own
   logprobs are taken over the same sets (`trl_correction.use_kept_sets`), so a fresh token's
   ratio is 1 and a stale one's is its importance weight under truncated sampling too (needs
   `GRPOConfig(top_k=...)`, as SGLang bounds a mask by it). Each record
   (`records`) counts the returned samples that had restarted for the bound; when they are
   10 % or more of a step's, the adapter logs a warning once (the bound is too tight).
6. At the end of training (`callback()`, or `close()`), it aborts and deletes every group it
   left on the server: nothing of the run stays buffered (background ones included).
7. Tools (agent rollouts): with `tool=` (a callable from a `ToolCall`: the turn's text and ids,
   the group's dataset row, to the answer as text or ids) and `turns=` (what ends a turn), a
   member whose turn ends there gets the tool's answer appended and goes on; rows hold the
   whole response with the answers in place and `env_mask` 0 on them, plus `april_tool_calls`
   (answers in the row). See `trl_tools.py`.

`background=True` keeps the server generating while TRL trains: training calls send
`on_quota: "continue"`, so the stragglers a call started and did not return keep generating
after it answered, until a later call claims them. The adapter keeps `background_level` groups
outstanding while the trainer trains: at least the next call's P (so that generation overlaps
training even with `over_provision = 1`), at least what over-provisioning leaves, and at most
`max_staleness * P` (work generated under the current weights must come back within
`max_staleness` calls of P groups each, or it is delivered staler than that or thrown away;
`trainer_batch.background_level` says why). Over-provisioning's extras are capped by that
level too. Right after each training call answers, the adapter prefetches what is missing
(`prefetch_groups`): it hands in (`POST /april/v1/groups`, `start: "background"`, the same
`max_staleness`) extra prompts drawn exactly as over-provisioning draws them, in the ledger as
sent (at the step whose call prefetched them; `StepRecord.prefetched` lists them). They
generate during the loss, the optimizer step and the weight push (which cuts them at the
version boundary and continues them under the new weights). Since every call sends its own P
prompts and returns P groups, the level, once reached, holds by itself: in steady state the
prefetch hands in nothing, and the groups each call sent but did not return are the next
training phase's work. Eval calls neither continue nor prefetch. With a bound, set
`max_inflight_groups` to P: the older (buffered) groups then start first and new ones fill in
as groups finish; with `"auto"` all of them may run at once, the new ones finish first and fill
the quota, and older ones left over pass `max_staleness` at the next push and restart from
their prompt (the train-demo, seed 0: 376 vs 252 restarts over 40 steps, the rollout wait
per step the same within noise).

`max_tokens_column`: when set, a dataset row's integer value in that column caps its group's
`max_new_tokens` (at most the trainer's `max_completion_length`): per-prompt answer budgets,
as in tasks whose answers differ widely in length (`make train-demo` uses it for its long tail).

How prompts become groups (rows as metadata, draws, specs) is `trl_prompts.py`.
"""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from . import AprilClient, NotFound
from ._routes import TurnsArg
from .sampling_mask import response_ids_and_offsets, sampling_logprobs
from .trainer_batch import (
    Ledger,
    StaleTokens,
    background_level,
    extra_groups,
    prefetch_groups,
    rows_from_groups,
    unique_prompts,
)
from .trl_correction import KeptRow, set_kept_rows, use_kept_sets, use_sampling_policy_as_old
from .trl_prompts import draw_prompts, group_spec, index_dataset, prompt_key, sampling_params
from .trl_tools import Tool, ToolLoop
from .weight_sync import WeightBroadcaster

logger = logging.getLogger(__name__)
# Warn (once per run) when at least this share of a step's returned samples had been thrown
# away and restarted from their prompt for max_staleness: the bound is too tight for them.
RESTART_WARN_SHARE = 0.1


@dataclass
class StepRecord:
    """What one rollout call did (kept in `AprilRollout.records`)."""

    call: int
    step: int
    mode: str
    weight_version: str
    sent: list[str]
    returned: list[str]
    stale_tokens: int
    output_tokens: int
    wall_s: float
    prefetched: list[str] = field(default_factory=list)  # handed in right after (background)
    returned_tokens: int = 0  # output tokens of the rows returned (output_tokens: generated
    # during the call, which leaves out what the background generated between calls)
    push_s: float = 0.0  # the weight push before this call (0 when none was due)
    # Of the returned samples: how many had restarted from their prompt for max_staleness,
    # and their restarts in all (the server's per-sample `staleness_restarts`).
    restarted_samples: int = 0
    staleness_restarts: int = 0


@dataclass
class AprilRollout:
    """A TRL `rollout_func` backed by april-server (see the module docstring)."""

    client: AprilClient
    over_provision: float = 1.0
    # Hold as many groups as the server advised after the last training call
    # (`stats.groups_wanted`, from its step curve and predicted lengths), never fewer than
    # `over_provision` x P. Needs `max_inflight_groups="auto"`: a pinned batch gets no advice.
    # The server bounds the advice by `max_staleness + 1` quotas (the default 1: at most
    # 2 x P), and with `background=True` what is held stays capped by `background_level`.
    size_pool: bool = False
    max_staleness: int | None = 1
    stale_tokens: StaleTokens = "mask"
    on_quota: Literal["snapshot", "tokens", "drop"] = "snapshot"
    max_inflight_groups: int | Literal["auto"] = "auto"
    push_weights: bool = True
    weight_sync: Literal["distributed", "disk"] = "distributed"
    master_address: str | None = None  # distributed: where the server reaches this trainer
    background: bool = False
    max_tokens_column: str | None = None
    weights_dir: str | None = None
    run_id: str = field(default_factory=lambda: "trl-" + uuid.uuid4().hex[:8])
    seed: int = 0
    ledger: Ledger = field(default_factory=Ledger)
    records: list[StepRecord] = field(default_factory=list)
    _pushed_step: int | None = None
    _pushed_dir: Path | None = None
    _broadcaster: WeightBroadcaster | None = None
    _calls: int = 0
    _metadata: dict[str, dict[str, Any]] | None = None  # prompt key -> row as JSON metadata
    _pool: list[tuple[str, Any]] = field(default_factory=list)  # training prompts, with keys
    tool: Tool | None = None  # agent rollouts: answers each turn (see trl_tools.py)
    turns: TurnsArg = None  # what ends a turn (needed with `tool`)
    _tools: ToolLoop | None = None
    _warned_restarts: bool = False
    _advised: int = 0  # the last training call's stats.groups_wanted (size_pool)
    # Return each token's kept set (top-k / top-p) and train over it: `logprobs` are over the
    # kept sets and so are the trainer's (trl_correction.py). Needs GRPOConfig(top_k=...).
    sampling_mask: bool = False

    def __post_init__(self) -> None:
        if self.tool is not None:
            self._tools = ToolLoop(self.tool, self.turns)
        if self.stale_tokens not in get_args(StaleTokens):
            raise ValueError(
                f"stale_tokens must be 'mask', 'keep' or 'correct', got {self.stale_tokens!r}"
            )
        if self.over_provision < 1.0:
            raise ValueError(f"over_provision must be >= 1.0, got {self.over_provision}")
        if self.size_pool and self.max_inflight_groups != "auto":
            raise ValueError(
                "size_pool needs max_inflight_groups='auto': a pinned batch gets no advice"
            )
        if self.weight_sync not in ("distributed", "disk"):
            raise ValueError(
                f"weight_sync must be 'distributed' or 'disk', got {self.weight_sync!r}"
            )

    # ---- the rollout function ----------------------------------------------------------------

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        if self.stale_tokens == "correct":
            use_sampling_policy_as_old(trainer)  # before TRL's first loss
        if self.sampling_mask:
            params = sampling_params(trainer)
            if "top_k" not in params and params["temperature"] > 0:  # SGLang's rule
                raise ValueError("sampling_mask=True needs a top_k: set GRPOConfig(top_k=...)")
            use_kept_sets(trainer)
        training = bool(trainer.model.training)
        n = trainer.num_generations if training else trainer.num_generations_eval
        step = int(trainer.state.global_step)
        push_s = 0.0
        if self.push_weights and step != self._pushed_step:
            t_push = time.perf_counter()
            self.push(trainer, step)
            push_s = time.perf_counter() - t_push
        firsts = unique_prompts(prompts, n)
        self._index_dataset(trainer)
        chosen = list(firsts)
        if training:
            outstanding = len(self.ledger.outstanding())
            advised = self._advised if self.size_pool else 0
            extra = extra_groups(len(firsts), self.over_provision, outstanding, advised)
            if self.background:  # never more outstanding after the call than the level
                level = background_level(len(firsts), self.over_provision, self.max_staleness)
                extra = min(extra, max(0, level - outstanding))
            chosen += self._draw(extra, firsts, step)
        call = self._calls
        self._calls += 1
        params = sampling_params(trainer)
        specs = [
            self._spec(f"{self.run_id}.c{call}.{k}", p, n, params, trainer, call, k)
            for k, p in enumerate(chosen)
        ]
        sent = [s["group_id"] for s in specs]
        t0 = time.perf_counter()
        self.ledger.on_sent(sent, step)
        on_quota = ("continue" if self.background else self.on_quota) if training else "drop"
        kw: dict[str, Any] = dict(
            resume_first=training,
            on_quota=on_quota,
            max_staleness=self.max_staleness,
            max_inflight_groups=self.max_inflight_groups,
            request_id=f"{self.run_id}.c{call}",
            return_sampling_mask=self.sampling_mask,
        )
        if self._tools is None:
            resp = self.client.rollout(specs, len(firsts), **kw)
        else:
            tok = trainer.processing_class
            resp = self._tools.rollout(self.client, specs, len(firsts), tok, **kw)
        returned = [g.group_id for g in resp.groups]
        self.ledger.on_returned(returned, step)
        if training:
            self._advised = resp.stats.groups_wanted or 0
        version = resp.stats.weight_version
        if self.push_weights and version != str(step):
            raise RuntimeError(f"server reports weight version {version!r} after pushing {step}")
        tool_calls: list[int] | None = None
        if self._tools is None:
            rows = rows_from_groups(resp.groups, n, version, self.stale_tokens)
        else:
            rows, tool_calls = self._tools.rows(resp.groups, n, version, self.stale_tokens)
        if self.sampling_mask:  # rows in group order, members by index, as built above
            samples = [s for g in resp.groups for s in sorted(g.samples, key=lambda s: s.index)]
            rows.logprobs = [sampling_logprobs(s) for s in samples]
            kept = [response_ids_and_offsets(s) for s in samples]
            rows_kept = zip(rows.prompt_ids, rows.completion_ids, kept, strict=True)
            set_kept_rows(trainer, [KeptRow(p, c, ids, off) for p, c, (ids, off) in rows_kept])
        wall_s = time.perf_counter() - t0
        prefetched = self._prefetch(firsts, n, params, trainer, step) if training else []
        restarts = [s.staleness_restarts for g in resp.groups for s in g.samples]
        record = StepRecord(
            call,
            step,
            "train" if training else "eval",
            version,
            sent,
            returned,
            rows.stale_tokens,
            resp.stats.output_tokens,
            wall_s,
            prefetched,
            sum(len(c) for c in rows.completion_ids),
            push_s,
            sum(1 for r in restarts if r),
            sum(restarts),
        )
        self.records.append(record)
        self._warn_restarts(record, len(restarts))
        out: dict[str, list[Any]] = {
            "prompt_ids": rows.prompt_ids,
            "completion_ids": rows.completion_ids,
            "logprobs": rows.logprobs,
            "env_mask": rows.env_mask,
            "april_group_id": rows.group_ids,
            "april_status": rows.statuses,
        }
        if tool_calls is not None:
            out["april_tool_calls"] = tool_calls
        for col in rows.columns():
            out[col] = [m[col] for m in rows.metadata]
        return out

    def _warn_restarts(self, record: StepRecord, samples: int) -> None:
        """Restarts for max_staleness throw generated tokens away; many mean answers take
        longer than the bound allows (docs/trainers.md, "Choosing max_staleness")."""
        if self._warned_restarts or not samples:
            return
        if record.restarted_samples < RESTART_WARN_SHARE * samples:
            return
        self._warned_restarts = True
        logger.warning(
            "april: %d of the %d samples returned at step %d had restarted from their prompt "
            "for max_staleness=%s (%d restarts in all): their answers take longer to generate "
            "than the bound allows, and every restart throws work away. Raise max_staleness "
            "(see docs/trainers.md, 'Choosing max_staleness'). Warned once per run.",
            record.restarted_samples,
            samples,
            record.step,
            self.max_staleness,
            record.staleness_restarts,
        )

    def _prefetch(
        self, firsts: list[Any], n: int, params: dict[str, Any], trainer: Any, step: int
    ) -> list[str]:
        """Hand in, generating in the background, the extras the next call would draw."""
        if not self.background:
            return []
        count = prefetch_groups(
            len(firsts), self.over_provision, len(self.ledger.outstanding()), self.max_staleness
        )
        chosen = self._draw(count, firsts, step)
        if not chosen:
            return []
        call = self._calls  # its own call number: ids and seeds unique in the run
        self._calls += 1
        specs = [
            self._spec(f"{self.run_id}.c{call}.{k}", p, n, params, trainer, call, k)
            for k, p in enumerate(chosen)
        ]
        ids = [s["group_id"] for s in specs]
        self.ledger.on_sent(ids, step)  # before sending: close() cleans up even a failed send
        self.client.add_groups(
            specs,
            start="background",
            max_staleness=self.max_staleness,
            request_id=f"{self.run_id}.c{call}",
            return_sampling_mask=self.sampling_mask,
        )
        return ids

    # ---- weights -----------------------------------------------------------------------------

    def push(self, trainer: Any, step: int) -> None:
        """The policy's weights into the server as weight version `step`."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        if self.weight_sync == "distributed":
            if self._broadcaster is None:
                self._broadcaster = WeightBroadcaster(self.client, self.master_address)
            resp = self._broadcaster.push(model.named_parameters(), str(step))
            if not resp.get("success", False):
                raise RuntimeError(f"weight push for step {step} failed: {resp.get('message')}")
            self._pushed_step = step
            return
        root = Path(self.weights_dir or tempfile.mkdtemp(prefix="april-weights-"))
        self.weights_dir = str(root)
        path = root / f"step-{step}"
        model.save_pretrained(path, safe_serialization=True)
        resp = self.client.update_weights_from_disk(str(path), weight_version=str(step))
        if not resp.get("success", False):
            raise RuntimeError(f"weight push for step {step} failed: {resp.get('message')}")
        if self._pushed_dir is not None:
            shutil.rmtree(self._pushed_dir, ignore_errors=True)
        self._pushed_step, self._pushed_dir = step, path

    # ---- end of training -----------------------------------------------------------------------

    def close(self) -> list[str]:
        """Abort and delete every group this run left on the server; returns their ids."""
        left = self.ledger.outstanding()
        if left:
            self.client.abort(group_ids=left, keep="drop")
            for gid in left:
                try:
                    self.client.delete_partial(gid)
                except NotFound:
                    pass  # `keep: drop` may have removed it already
                self.ledger.cleared.add(gid)
        if self._pushed_dir is not None:
            shutil.rmtree(self._pushed_dir, ignore_errors=True)
        if self._broadcaster is not None:
            self._broadcaster.close()
            self._broadcaster = None
        return left

    def callback(self) -> Any:
        """A transformers `TrainerCallback` that calls `close()` when training ends."""
        from transformers import TrainerCallback

        adapter = self

        class _CloseAtEnd(TrainerCallback):
            def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                adapter.close()

        return _CloseAtEnd()

    # ---- prompts, rows, specs (trl_prompts.py) ------------------------------------------------

    def _index_dataset(self, trainer: Any) -> None:
        """Each prompt's row as JSON metadata, and the training prompts (built once)."""
        if self._metadata is None:
            self._metadata, pool = index_dataset(trainer)
            self._pool.extend(pool)

    def _draw(self, count: int, exclude: Sequence[Any], step: int) -> list[Any]:
        """`count` distinct prompts from the training set, none of this step's own."""
        rng = random.Random(f"{self.seed}:{self.run_id}:{step}:{self._calls}")
        return draw_prompts(self._pool, count, exclude, rng)

    def _spec(
        self, gid: str, prompt: Any, n: int, params: dict[str, Any], trainer: Any, call: int, k: int
    ) -> dict[str, Any]:
        metadata = (self._metadata or {}).get(prompt_key(prompt), {})
        seed = (self.seed * 1_000_003 + call * 10_007 + k * n) % 2**31
        tokenizer = trainer.processing_class
        return group_spec(gid, prompt, n, params, tokenizer, metadata, self.max_tokens_column, seed)

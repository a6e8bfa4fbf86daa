"""slime adapter: `--rollout-function-path april_client.slime.generate_rollout`.

slime calls `generate_rollout(args, rollout_id, data_source, evaluation=False)` once per
rollout (`slime/ray/rollout.py`, through `call_rollout_fn`) and trains on the
`RolloutFnTrainOutput(samples=...)` it returns: `args.rollout_batch_size` groups of
`args.n_samples_per_prompt` `Sample`s. This one makes that rollout one `POST /april/v1/rollouts`
call on april-server, whose address is slime's router address (`--sglang-router-ip`,
`--sglang-router-port`), and nothing else changes in slime:

- Over-sampling is the server's pool: the call holds `--over-sampling-batch-size` groups in all,
  the groups the server still buffers from earlier rollouts first (oldest first, with their KV
  snapshot), then new prompts from `data_source.get_samples(k)` for the rest. It answers with
  exactly `rollout_batch_size` finished groups, in finish order; slime sorts them by index as
  its own rollout does.
- `--partial-rollout`: the unfinished groups stay on the server (durable, with their KV) and
  are served first by the next rollout; slime's data source never sees them (its buffer only
  ever holds what slime itself adds). Without it, the stragglers are discarded (`on_quota:
  drop`), as slime's own rollout drops them.
- `--mask-offpolicy-in-partial-rollout`: loss mask 0 on the tokens sampled under an older
  weight version than the current one (the server records each token's version).
- Rewards come from slime's own reward hub (`slime.rollout.rm_hub.async_rm`, which honours
  `--custom-rm-path`, `--rm-type` and a sample's own `custom_rm_path`), or its batched form
  with `--group-rm`; `--rollout-sample-filter-path` and `--rollout-all-samples-process-path`
  are called as slime's rollout calls them.
- Sampling follows slime's own (`GenerateState`): `--rollout-temperature`, `-top-p`, `-top-k`,
  `--rollout-max-response-len`, stops; with `--sglang-enable-deterministic-inference` each
  group's seed is `--rollout-seed`, so member i samples with `rollout_seed + i`, as slime's.
- `--use-rollout-routing-replay` asks the server for routing (`rollout_routed_experts`).
- `--rollout-top-p` below 1 (slime then asks SGLang for `return_top_p_token_ids`) asks the server
  for sampling masks (`return_sampling_mask`), kept across every cut, and fills slime's top-p
  replay fields `rollout_top_p_token_ids` / `rollout_top_p_token_offsets` from them. The server
  bounds a mask's row by a finite top-k: slime's top-k -1 is sent as the vocabulary's size
  (the same distribution), which must be within the server's `--sampling-mask-max-tokens`.
- Weight updates are slime's own, unchanged: its engines send `weight_version` with every update
  (disk, tensor, distributed), which is what the server's staleness and snapshots need.
- Two optional attributes of `args` (slime's parser does not define them; set them with a
  custom config) reach the call: `april_max_staleness` (restart a buffered sample whose newest
  segment is more versions old; default none) and `april_max_inflight_groups` (default
  `"auto"`: the server sizes the running batch; an integer pins it).
- `evaluation=True` runs slime's own evaluation rollout (`slime.rollout.sglang_rollout`), which
  generates with stock `/generate` on the same server: no quota, nothing buffered.

What one process keeps between rollouts (`runs()`): the client, the prompt Samples of the groups
it sent (a group sent by an earlier process is rebuilt from the metadata it carries), and a
record per rollout. slime is imported when first used (`_framework.py`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ._framework import framework
from ._sync import AprilClient
from .protocol import Group, RolloutResp
from .slime_samples import fill_member, group_metadata, prompt_ids, rebuild_members, sent_at

CALL_TIMEOUT_S = 3600.0  # one rollout call runs until its quota is met: long on a slow engine
UNSUPPORTED = {
    "custom_generate_function_path": "the server generates: a custom generate function "
    "(multi-turn agents) has no place in a quota call",
    "dynamic_sampling_filter_path": "dynamic sampling filters are not applied by the adapter",
}


@dataclass
class RolloutRecord:
    """What one training rollout did (kept in `SlimeRun.records`)."""

    rollout_id: int
    sent: list[str]  # new groups handed in by this rollout
    returned: list[str]  # the rollout_batch_size groups it returned, in finish order
    carried: list[str]  # of those, groups sent by an earlier rollout
    buffered_before: int  # groups the server held when it started
    buffered_after: list[str]  # groups the call left on the server
    dropped: list[str]
    weight_version: str


@dataclass
class SlimeRun:
    """One process's state for one server (slime builds its rollout state the same way)."""

    url: str
    client: AprilClient
    run_id: str = field(default_factory=lambda: "slime-" + uuid.uuid4().hex[:8])
    originals: dict[str, list[Any]] = field(default_factory=dict)  # group id -> Samples sent
    records: list[RolloutRecord] = field(default_factory=list)
    last_response: RolloutResp | None = None
    tokenizer: Any = None


_RUNS: dict[str, SlimeRun] = {}


def runs() -> dict[str, SlimeRun]:
    """This process's runs, by server URL."""
    return _RUNS


def server_url(args: Any) -> str:
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}"


def run_for(args: Any) -> SlimeRun:
    url = server_url(args)
    if url not in _RUNS:
        _RUNS[url] = SlimeRun(url, AprilClient(url, timeout=CALL_TIMEOUT_S))
    return _RUNS[url]


def check_args(args: Any) -> int:
    """The over-sampling size, after refusing settings the adapter cannot honour."""
    for name, why in UNSUPPORTED.items():
        if getattr(args, name, None):
            raise ValueError(f"april_client.slime: --{name.replace('_', '-')} is set, but {why}")
    target = int(args.rollout_batch_size)
    over = getattr(args, "over_sampling_batch_size", None) or target
    if target < 1:
        raise ValueError(f"--rollout-batch-size must be >= 1, got {target}")
    if over < target:
        raise ValueError(
            f"--over-sampling-batch-size ({over}) must be at least --rollout-batch-size "
            f"({target}): the server returns rollout_batch_size groups from that pool"
        )
    if int(args.n_samples_per_prompt) < 1:
        raise ValueError(f"--n-samples-per-prompt must be >= 1, got {args.n_samples_per_prompt}")
    return int(over)


def wants_masks(args: Any) -> bool:
    """slime asks for top-p replay (`return_top_p_token_ids`) whenever its top-p is not 1."""
    return float(args.rollout_top_p) != 1.0


def sampling_params(args: Any, vocab_size: int | None = None) -> dict[str, Any]:
    """slime's rollout sampling parameters (`GenerateState`), as the server takes them. With
    top-p replay the server needs a finite top-k to bound a mask's row: top-p alone (slime's
    top_k -1) becomes top_k = the vocabulary's size, the same distribution."""
    params = dict(
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        max_new_tokens=args.rollout_max_response_len,
        stop=args.rollout_stop,
        stop_token_ids=args.rollout_stop_token_ids,
        skip_special_tokens=args.rollout_skip_special_tokens,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )
    if wants_masks(args) and (args.rollout_top_k is None or args.rollout_top_k < 1):
        if vocab_size is None:
            raise ValueError("top-p replay with top_k -1 needs the vocabulary's size")
        params["top_k"] = int(vocab_size)
    return {k: v for k, v in params.items() if v is not None}


def group_specs(
    args: Any, run: SlimeRun, groups: Sequence[Sequence[Any]], rollout_id: int
) -> list[dict[str, Any]]:
    params = sampling_params(args, len(run.tokenizer) if wants_masks(args) else None)
    deterministic = bool(getattr(args, "sglang_enable_deterministic_inference", False))
    specs = []
    for k, group in enumerate(groups):
        if len(group) != args.n_samples_per_prompt:
            raise ValueError(
                f"the data source gave a group of {len(group)}, not --n-samples-per-prompt "
                f"({args.n_samples_per_prompt})"
            )
        gid = f"{run.run_id}.r{rollout_id}.{k}"
        spec: dict[str, Any] = dict(
            group_id=gid,
            n=len(group),
            input_ids=prompt_ids(group[0], run.tokenizer),
            sampling_params=params,
            metadata=group_metadata(group, rollout_id),
        )
        if deterministic:
            spec["seed"] = int(args.rollout_seed)
        specs.append(spec)
        run.originals[gid] = list(group)
    return specs


def slime_group(args: Any, run: SlimeRun, group: Group, version: str, rollout_id: int) -> list[Any]:
    types = framework("slime.utils.types")
    members = rebuild_members(types.Sample, group, run.originals.pop(group.group_id, None))
    mask = bool(args.partial_rollout and args.mask_offpolicy_in_partial_rollout)
    skip = bool(args.rollout_skip_special_tokens)

    def decode(ids: list[int]) -> str:
        return str(run.tokenizer.decode(ids, skip_special_tokens=skip))

    started = sent_at(group)
    for out, sample in zip(members, sorted(group.samples, key=lambda s: s.index), strict=True):
        fill_member(out, sample, current_version=version, mask_offpolicy=mask, decode=decode)
        if started is not None and started < rollout_id:
            out.metadata.setdefault("start_rollout_id", started)  # slime's partial marker
        out.metadata["april_group_id"] = group.group_id
    return members


async def rewards(args: Any, data: list[list[Any]]) -> None:
    """slime's own reward hub, as its rollout calls it (per sample, or per group)."""
    rm_hub = framework("slime.rollout.rm_hub")
    if args.group_rm:
        scores = await asyncio.gather(*(rm_hub.batched_async_rm(args, g) for g in data))
        for g, rs in zip(data, scores, strict=True):
            for s, r in zip(g, rs, strict=True):
                s.reward = r
        return
    todo = [s for g in data for s in g if s.reward is None]
    scores = await asyncio.gather(*(rm_hub.async_rm(args, s) for s in todo))
    for s, r in zip(todo, scores, strict=True):
        s.reward = r


def train_rollout(args: Any, rollout_id: int, data_source: Any) -> Any:
    base = framework("slime.rollout.base_types")
    misc = framework("slime.utils.misc")
    over = check_args(args)
    run = run_for(args)
    if run.tokenizer is None:
        run.tokenizer = framework("slime.utils.processing_utils").load_tokenizer(
            args.hf_checkpoint, trust_remote_code=True
        )
    before = int(run.client.stats()["buffered_groups"])
    new = max(0, over - before)  # over >= rollout_batch_size (check_args)
    specs = group_specs(args, run, data_source.get_samples(new) if new else [], rollout_id)
    resp = run.client.rollout(
        specs,
        int(args.rollout_batch_size),
        resume_first=True,
        on_quota="snapshot" if args.partial_rollout else "drop",
        max_staleness=getattr(args, "april_max_staleness", None),
        max_inflight_groups=getattr(args, "april_max_inflight_groups", "auto"),
        request_id=f"{run.run_id}.r{rollout_id}",
        return_routed_experts=bool(getattr(args, "use_rollout_routing_replay", False)),
        return_sampling_mask=wants_masks(args),
    )
    run.last_response = resp
    version = resp.stats.weight_version
    data = [slime_group(args, run, g, version, rollout_id) for g in resp.groups]
    for gid in resp.dropped_group_ids:
        run.originals.pop(gid, None)
    framework("slime.utils.async_utils").run(rewards(args, data))
    carried = [g.group_id for g in resp.groups if sent_at(g) not in (None, rollout_id)]
    run.records.append(
        RolloutRecord(
            rollout_id,
            [s["group_id"] for s in specs],
            [g.group_id for g in resp.groups],
            carried,
            before,
            list(resp.buffered_group_ids),
            list(resp.dropped_group_ids),
            version,
        )
    )
    data.sort(key=lambda g: g[0].index)
    if args.rollout_sample_filter_path is not None:
        misc.load_function(args.rollout_sample_filter_path)(args, data)
    if args.rollout_all_samples_process_path is not None:
        misc.load_function(args.rollout_all_samples_process_path)(args, data, data_source)
    metrics = {
        "april/buffered_groups": float(len(resp.buffered_group_ids)),
        "april/carried_groups": float(len(carried)),
        "april/offpolicy_fraction": float(resp.stats.offpolicy_fraction),
        "april/restored_kv_tokens": float(resp.stats.restored_kv_tokens),
        "april/recomputed_tokens": float(resp.stats.recomputed_tokens),
    }
    return base.RolloutFnTrainOutput(samples=data, metrics=metrics)


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's rollout function (see the module docstring)."""
    if evaluation:
        stock = framework("slime.rollout.sglang_rollout")
        return stock.generate_rollout(args, rollout_id, data_source, evaluation=True)
    return train_rollout(args, rollout_id, data_source)

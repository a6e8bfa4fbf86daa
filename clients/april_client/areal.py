"""AReaL adapter (AReaL 1.0.4): a `RolloutWorkflow` whose episodes come from april-server.

    trainer.train(workflow="april_client.areal.AprilWorkflow", workflow_kwargs=dict(
        reward_fn=..., gconfig=config.gconfig, tokenizer=config.tokenizer_path))

takes the place of `areal.workflow.rlvr.RLVRWorkflow` with the same arguments (and optional
`over_provision`, `max_staleness`, `tool`, `turns`, `url`). AReaL runs `arun_episode(engine,
data)` once per member of each prompt's group (`GroupedRolloutWorkflow`, `group_size =
gconfig.n_samples`) and gathers `batch_size` such groups per step (`prepare_batch`). Here:

- the members of one `data` row (the same object, gathered together) are one server group of
  `n`: an episode ticket. Tickets are served by quota calls (`areal_batch.py`): each call hands
  in the new tickets' groups and returns `ceil(waiting tickets / over_provision)` finished
  groups, buffered ones first; each returned group answers the oldest waiting ticket, member i
  its i-th episode. Groups not returned stay on the server (with their KV) and answer later
  tickets; with `over_provision = 1` every call waits for all of its groups.
- each episode is the rlvr-shaped dict AReaL trains on (`input_ids`, `loss_mask`, `logprobs`,
  `versions` (per token, the weight version that sampled it; -1 on the prompt and on tool
  answers; tokens of the server's start-up weights, before any push, get the engine's version
  at the workflow's first episode), `attention_mask`, `rewards`), built from the group that
  answered the ticket and scored with `reward_fn` against that group's own `data` row;
- with `tool` and `turns`, a member whose turn ends at a turn stop gets `tool(ToolCall)`'s answer
  appended and goes on (`trl_tools.rollout_with_tool`); answers carry loss mask 0.
- weights: AReaL sends `/update_weights_from_disk` and `_from_distributed` with
  `abort_all_requests` and no version, and counts versions itself (`engine.set_version`). On
  its first episode the workflow makes the engine's request builder add
  `weight_version = str(meta.version)` to both (`install_weight_versions`), so the server's
  segments carry AReaL's version numbers; the abort keeps every token (the server continues
  them under the new weights).

The server's address is the engine's (AReaL is pointed at april-server as its SGLang server),
or `url`. AReaL is imported when first used; the workflow class is built on first access.
"""

from __future__ import annotations

import functools
from typing import Any

from .protocol import Sample
from .trainer_batch import response_logprobs, response_mask, token_versions


def int_versions(sample: Sample, initial: int) -> list[int]:
    """Per `response_ids` token: its weight version as AReaL's integer version (-1 on appended
    context). A version that is not a number is the server's start-up label (`default`, before
    any push): the weights AReaL counts as its `initial` version."""
    out = []
    for v in token_versions(sample):
        if v is None:
            out.append(-1)
        else:
            out.append(int(v) if v.lstrip("-").isdigit() else initial)
    return out


def episode_lists(
    sample: Sample, current_version: str, stale: str, initial: int = 0
) -> dict[str, list[Any]]:
    """The rlvr episode's sequences for one finished member, before tensors."""
    prompt = list(sample.prompt_ids)
    response = sample.response_ids
    mask = response_mask(sample, current_version, "mask" if stale == "mask" else "keep")
    return {
        "input_ids": prompt + response,
        "loss_mask": [0] * len(prompt) + mask,
        "logprobs": [0.0] * len(prompt) + response_logprobs(sample),
        "versions": [-1] * len(prompt) + int_versions(sample, initial),
    }


def install_weight_versions(engine: Any) -> bool:
    """Make an AReaL remote engine's weight-update requests carry `weight_version`
    (`str(meta.version)`), once. False when the engine has no such request builder."""
    inner = getattr(engine, "_engine", engine)
    backend = getattr(inner, "backend", None)
    if backend is None or getattr(backend, "april_versions", False):
        return backend is not None
    for name in ("build_disk_weight_update_requests", "build_distributed_weight_update_requests"):
        original = getattr(backend, name)

        @functools.wraps(original)
        def versioned(meta: Any, *args: Any, _original: Any = original, **kw: Any) -> Any:
            reqs = _original(meta, *args, **kw)
            if getattr(meta, "version", None) is not None:
                for req in reqs.requests:
                    if req.endpoint.startswith("/update_weights_from_"):
                        req.payload["weight_version"] = str(meta.version)
            return reqs

        setattr(backend, name, versioned)
    backend.april_versions = True
    return True


def engine_url(engine: Any) -> str:
    inner = getattr(engine, "_engine", engine)
    addresses = getattr(inner, "addresses", None)
    if not addresses:
        raise ValueError(
            "april_client.areal: the engine has no server address; pass url= to the workflow"
        )
    addr = str(addresses[0])
    return addr if addr.startswith("http") else f"http://{addr}"


def __getattr__(name: str) -> Any:
    """`AprilWorkflow`: a subclass of AReaL's `RolloutWorkflow`, built on first access (AReaL
    imports workflows by their string path)."""
    if name == "AprilWorkflow":
        from .areal_batch import workflow_class

        return workflow_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

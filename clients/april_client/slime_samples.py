"""slime's `Sample` to and from april-server's groups (for `slime.py`).

A slime group (`n_samples_per_prompt` copies of one prompt `Sample`) becomes one group spec;
the prompt `Sample`'s own fields travel in the group's `metadata` (JSON), so a group that comes
back in a later rollout, or after the trainer restarted, is rebuilt with its own prompt, label
and metadata. Each returned member fills the fields slime's training reads
(`RolloutManager._convert_samples_to_train_data`): `tokens`, `response`, `response_length`,
`loss_mask`, `rollout_log_probs`, `weight_versions`, `status`, with routing replay
`rollout_routed_experts`, and with top-p replay `rollout_top_p_token_ids` / `_offsets` (the
server's sampling mask, docs/api.md, Sampling mask).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import msgspec

from .protocol import Group
from .protocol import Sample as AprilSample
from .sampling_mask import response_ids_and_offsets
from .trainer_batch import response_logprobs, response_mask

KEY = "slime"  # the group metadata's key for the prompt Sample's fields
PROMPT_FIELDS = ("prompt", "label", "metadata", "custom_rm_path", "apply_chat_template_kwargs")


def prompt_ids(sample: Any, tokenizer: Any) -> list[int]:
    """The prompt's token ids as slime's own `generate` takes them: the Sample's `tokens` when
    the data source filled them, else its text through the tokenizer, no special tokens."""
    if sample.multimodal_inputs and any(v is not None for v in sample.multimodal_inputs.values()):
        raise ValueError(
            "april_client.slime sends token ids; multimodal prompts (images, video, audio) are "
            "not supported"
        )
    if sample.tokens:
        return [int(t) for t in sample.tokens]
    if not isinstance(sample.prompt, str):
        raise ValueError(
            f"a prompt of type {type(sample.prompt).__name__} needs --apply-chat-template (the "
            "adapter tokenizes text prompts)"
        )
    return [int(t) for t in tokenizer.encode(sample.prompt, add_special_tokens=False)]


def group_metadata(group: Sequence[Any], rollout_id: int) -> dict[str, Any]:
    """What rebuilds the slime group: the prompt Sample's fields, each member's indices, and
    the rollout that sent it. Refuses what JSON cannot carry."""
    first = group[0]
    fields = {name: getattr(first, name) for name in PROMPT_FIELDS}
    meta = {
        KEY: {
            **fields,
            "group_index": first.group_index,
            "indices": [s.index for s in group],
            "rollout_ids": [s.rollout_id for s in group],
            "sent_at_rollout": rollout_id,
        }
    }
    try:
        msgspec.json.encode(meta)
    except (TypeError, msgspec.EncodeError) as exc:
        raise TypeError(
            f"group {first.group_index}: the prompt Sample's fields must be JSON (they travel "
            f"with the group on the server): {exc}"
        ) from exc
    return meta


def rebuild_members(sample_cls: Any, group: Group, originals: Sequence[Any] | None) -> list[Any]:
    """The slime group's members before generation: copies of the Samples this process sent,
    or (a group sent by an earlier process) rebuilt from the group's metadata."""
    n = len(group.samples)
    if originals is not None:
        if len(originals) != n:
            raise ValueError(f"group {group.group_id}: {len(originals)} Samples sent, {n} back")
        return [copy.deepcopy(s) for s in originals]
    meta = group.metadata.get(KEY) if isinstance(group.metadata, dict) else None
    if not isinstance(meta, dict):
        raise ValueError(
            f"group {group.group_id} carries no slime metadata: it was not sent by "
            "april_client.slime (another client's group on the same server?)"
        )
    out = []
    for i in range(n):
        s = sample_cls(**{name: copy.deepcopy(meta.get(name)) for name in PROMPT_FIELDS})
        if s.metadata is None:
            s.metadata = {}
        if s.apply_chat_template_kwargs is None:
            s.apply_chat_template_kwargs = {}
        s.group_index = meta.get("group_index")
        s.index = meta["indices"][i]
        s.rollout_id = meta["rollout_ids"][i]
        out.append(s)
    return out


def sent_at(group: Group) -> int | None:
    """The rollout that sent the group (None: not a slime group)."""
    meta = group.metadata.get(KEY) if isinstance(group.metadata, dict) else None
    at = meta.get("sent_at_rollout") if isinstance(meta, dict) else None
    return at if isinstance(at, int) else None


def fill_member(
    out: Any,
    sample: AprilSample,
    *,
    current_version: str,
    mask_offpolicy: bool,
    decode: Any,
) -> None:
    """Fill slime's generated fields of `out` from the server's finished member `sample`.

    `mask_offpolicy` (slime's `--mask-offpolicy-in-partial-rollout`): tokens sampled under a
    weight version other than the current one get loss mask 0 (slime's own masks every token
    generated before the rollout that finished the sample; the server knows each token's
    version, so it masks exactly the older ones).
    """
    if sample.status not in ("completed", "truncated"):
        raise ValueError(f"sample {sample.sample_id} is unfinished ({sample.status})")
    response = sample.response_ids
    out.tokens = list(sample.prompt_ids) + response
    out.response_length = len(response)
    out.response = decode(response)
    out.rollout_log_probs = response_logprobs(sample)
    out.loss_mask = response_mask(sample, current_version, "mask" if mask_offpolicy else "keep")
    out.weight_versions = [seg.weight_version for seg in sample.segments]
    status = out.Status.COMPLETED if sample.status == "completed" else out.Status.TRUNCATED
    out.status = status
    for seg in sample.segments:
        out.prefix_cache_info.cached_tokens += seg.cached_tokens
    if sample.routing is not None:
        from .routed_experts import experts

        out.rollout_routed_experts = experts(sample.routing).astype("int32")
    if sample.sampling_mask is not None:
        # slime's top-p replay: each response token's kept ids (an empty span on tool answers)
        ids, offsets = response_ids_and_offsets(sample)
        out.rollout_top_p_token_ids, out.rollout_top_p_token_offsets = ids, offsets

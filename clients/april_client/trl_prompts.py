"""The TRL adapter's prompts as april groups: rows as metadata, draws, group specs.

Each dataset row becomes the `metadata` of the groups of its prompt (the columns that survive
JSON), keyed by the prompt (`prompt_key`); over-provisioning and the background's prefetch draw
distinct training prompts (`draw_prompts`); a prompt becomes one group spec with the trainer's
sampling parameters, tokenized as TRL would tokenize it (`group_spec`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec


def index_dataset(trainer: Any) -> tuple[dict[str, dict[str, Any]], list[tuple[str, Any]]]:
    """Each prompt's row as JSON metadata, and the training prompts with their keys."""
    metadata: dict[str, dict[str, Any]] = {}
    pool: list[tuple[str, Any]] = []
    for ds in (trainer.train_dataset, getattr(trainer, "eval_dataset", None)):
        if ds is None or isinstance(ds, dict):
            continue
        for row in ds:
            key = prompt_key(row["prompt"])
            if key not in metadata:
                metadata[key] = _jsonable(row)
            if ds is trainer.train_dataset:
                pool.append((key, row["prompt"]))
    return metadata, pool


def draw_prompts(
    pool: Sequence[tuple[str, Any]], count: int, exclude: Sequence[Any], rng: random.Random
) -> list[Any]:
    """`count` distinct prompts from the training set `pool`, none of `exclude`.

    Samples about as many indices as it needs (not a permutation of the whole set, which
    would cost time proportional to the dataset every step); a full permutation only when
    duplicates or exclusions leave it short.
    """
    taken = {prompt_key(p) for p in exclude}
    out: list[Any] = []
    for i in _candidates(rng, len(pool), 2 * (count + len(taken))):
        if len(out) == count:
            break
        key, prompt = pool[i]
        if key not in taken:
            taken.add(key)
            out.append(prompt)
    return out


def group_spec(
    gid: str,
    prompt: Any,
    n: int,
    params: dict[str, Any],
    tokenizer: Any,
    metadata: dict[str, Any],
    max_tokens_column: str | None,
    seed: int,
) -> dict[str, Any]:
    """One group of `n` for `prompt`; its row's `max_tokens_column` caps its budget."""
    budget = metadata.get(max_tokens_column) if max_tokens_column else None
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
        params = {**params, "max_new_tokens": min(budget, int(params["max_new_tokens"]))}
    return {
        "group_id": gid,
        "input_ids": _encode(prompt, tokenizer),
        "n": n,
        "sampling_params": params,
        "seed": seed,
        "metadata": metadata,
    }


def sampling_params(trainer: Any) -> dict[str, Any]:
    """The trainer's sampling settings as SGLang's sampling parameters."""
    params: dict[str, Any] = {
        "max_new_tokens": int(trainer.max_completion_length),
        "temperature": float(trainer.temperature),
        "top_p": float(trainer.top_p),
        "min_p": float(trainer.min_p or 0.0),
        "repetition_penalty": float(trainer.repetition_penalty),
    }
    if trainer.top_k:
        params["top_k"] = int(trainer.top_k)
    return params


def prompt_key(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def _candidates(rng: random.Random, size: int, first: int) -> Iterator[int]:
    yield from rng.sample(range(size), min(size, first))
    yield from rng.sample(range(size), size)  # only reached when the first draw fell short


def _encode(prompt: Any, tokenizer: Any) -> list[int]:
    """Token ids as TRL would build them: chat template for messages, plain text otherwise."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """The row's columns that survive JSON (images and tensors are left out of `metadata`)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key == "prompt":
            continue
        try:
            msgspec.json.encode(value)
        except (TypeError, msgspec.EncodeError):
            continue
        out[key] = value
    return out

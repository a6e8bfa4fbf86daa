"""The weight routes a trainer pushes with, shared by the sync and async clients (like
`_routes.py`): SGLang's own, answered the same way by april-server and by an owner over many
engines (docs/api.md, "Weights over the wire"), plus where the group stands."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from ._routes import PREFIX, Call, _dict_decoder, _encode_obj
from .protocol import WeightGroupInfo

_group_decoder = msgspec.json.Decoder(WeightGroupInfo)


def weight_group() -> Call[WeightGroupInfo]:
    return Call("GET", PREFIX + "/weights/group", _group_decoder.decode, idempotent=True)


def update_weights_from_disk(
    model_path: str, weight_version: str | None, extra: Mapping[str, Any]
) -> Call[dict[str, Any]]:
    body: dict[str, Any] = {"model_path": model_path}
    if weight_version is not None:
        body["weight_version"] = weight_version
    body.update(extra)
    return Call("POST", "/update_weights_from_disk", _dict_decoder.decode, _encode_obj(body))


def init_weights_update_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str,
    backend: str,
    rank_offset: int = 1,
) -> Call[dict[str, Any]]:
    if world_size < 2 or not 0 < rank_offset < world_size:
        raise ValueError(f"world_size {world_size} with rank_offset {rank_offset}")
    body = {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }
    return Call("POST", "/init_weights_update_group", _dict_decoder.decode, _encode_obj(body))


def destroy_weights_update_group(group_name: str) -> Call[dict[str, Any]]:
    body = _encode_obj({"group_name": group_name})
    return Call("POST", "/destroy_weights_update_group", _dict_decoder.decode, body)


def weight_session(edge: str) -> Call[dict[str, Any]]:
    """`begin` or `end` of SGLang's weight-update session (0.5.23 requires one around a
    distributed update)."""
    return Call("POST", f"/{edge}_weight_update", _dict_decoder.decode, _encode_obj({}))


def update_weights_from_distributed(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group_name: str,
    weight_version: str | None,
    extra: Mapping[str, Any],
) -> Call[dict[str, Any]]:
    if not len(names) == len(dtypes) == len(shapes) or not names:
        raise ValueError("names, dtypes and shapes: one of each per tensor, at least one")
    body: dict[str, Any] = {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(s) for s in shapes],
        "group_name": group_name,
    }
    if weight_version is not None:
        body["weight_version"] = weight_version
    body.update(extra)
    return Call("POST", "/update_weights_from_distributed", _dict_decoder.decode, _encode_obj(body))

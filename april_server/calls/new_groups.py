"""Step 2 of a call (and of `POST /groups`): validate the sent groups and build them; nothing
is added on bad input."""

from __future__ import annotations

import asyncio
import secrets

import msgspec

from april_client.protocol import Group, GroupSpec, TurnsSpec
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.engine.base import BaseEngine
from april_server.rules import samples as sample_rules
from april_server.rules import sampling_mask as mask_rules
from april_server.rules.routing_replay import check_wanted as check_routing
from april_server.rules.turns import check_spec
from april_server.wire.errors import bad_request, conflict
from april_server.wire.ids import check_id

_enc = msgspec.json.Encoder()
YIELD_EVERY = 256  # groups validated between two yields to the event loop


async def new_groups(
    engine: BaseEngine,
    buffer: PartialBuffer,
    specs: list[GroupSpec],
    handed_in: frozenset[str] = frozenset(),
    turns: TurnsSpec | None = None,
    routing: bool = False,
    mask: bool = False,
) -> list[Group]:
    """Validate the request's groups and build them; raises ApiError, changes nothing. A big
    call yields to the event loop as it goes, so other requests are not held up. Groups in
    `handed_in` (an earlier attempt of the same `request_id` already handed them in) are
    checked for their id only, and not built again. `turns`: the call's turn rule, for
    groups that carry none; `routing`, `mask`: the call's `return_routed_experts` and
    `return_sampling_mask`."""
    check_spec(turns, "turns", engine.vocab_size)
    seen: set[str] = set()
    built = []
    for i, spec in enumerate(specs):
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)
        check_id("group_id", spec.group_id)
        if spec.group_id in seen:
            raise bad_request("duplicate_group_id", f"group_id {spec.group_id!r} is repeated")
        seen.add(spec.group_id)
        if spec.group_id in handed_in:
            continue
        if buffer.known(spec.group_id):
            raise conflict("group_exists", f"group {spec.group_id!r} is already known")
        if (spec.input_ids is None) == (spec.text is None):
            raise bad_request(
                "invalid_prompt", f"group {spec.group_id!r}: give exactly one of input_ids, text"
            )
        prompt = spec.input_ids
        if prompt is None:
            prompt = engine.tokenize(spec.text or "")
        if spec.seed is None and engine.assigns_seeds:
            spec = msgspec.structs.replace(spec, seed=secrets.randbelow(2**31 - 2**16))
        for params in [spec.sampling_params, *(spec.member_params or [])]:
            engine.check_sampling_params({k: v for k, v in params.items()})
        check_spec(spec.turns, f"group {spec.group_id!r}: turns", engine.vocab_size)
        wants = routing if spec.return_routed_experts is None else spec.return_routed_experts
        check_routing(wants, engine.routing_format, f"group {spec.group_id!r}")
        group = sample_rules.build_group(
            spec, prompt, engine.context_len, engine.vocab_size, turns, routing, mask
        )
        _check_as_sent(engine, group)
        built.append(group)
    return built


def _check_as_sent(engine: BaseEngine, group: Group) -> None:
    """What each member's first segment sends (its params over the group's, the turn stops,
    its budget, its seed) must pass SGLang's checks too, or every segment of it fails after a
    200 and it never finishes: e.g. 33 stop strings, `min_new_tokens` over a member's budget,
    a seed past int64; a sampling mask SGLang would refuse to return. Each distinct set of
    params is checked once."""
    checked: set[bytes] = set()
    for s in group.samples:
        if s.seed is not None and not -(2**63) <= s.seed < 2**63:
            raise bad_request(
                "invalid_sampling_params",
                f"group {group.group_id!r}: member {s.index}'s seed {s.seed} (seed + index) "
                "is outside int64",
            )
        floor = s.sampling_params.get("min_new_tokens") or 0
        if isinstance(floor, int) and floor > s.max_new_tokens:  # a continuation caps it
            raise bad_request(
                "invalid_sampling_params",
                f"group {group.group_id!r}: member {s.index}'s min_new_tokens {floor} exceeds "
                f"its max_new_tokens {s.max_new_tokens}",
            )
        key = _enc.encode((s.sampling_params, s.max_new_tokens))
        if key in checked:
            continue
        checked.add(key)
        params = sample_rules.plan_continuation(s, "", None).sampling_params
        params.pop("sampling_seed", None)
        engine.check_sampling_params(params)
        if s.return_sampling_mask:
            where = f"group {group.group_id!r} member {s.index}"
            mask_rules.check_params(params, engine.sampling_mask_tokens, where)

"""Groups for the call tests over the fake engine: a spec that generates its whole budget
(EOS ignored, greedy), and a buffer left holding partial groups."""

from __future__ import annotations

from april_client.protocol import GroupSpec, RolloutReq
from april_server.root.manager import RolloutManager

NO_EOS = {"ignore_eos": True, "temperature": 0.0}


def spec(gid: str, budget: int, n: int = 1) -> GroupSpec:
    return GroupSpec(
        gid, n=n, input_ids=[1, 2, 3], sampling_params={"max_new_tokens": budget, **NO_EOS}
    )


async def buffered(mgr: RolloutManager, gids: list[str], budget: int = 200) -> None:
    """Leave `gids` idle in the buffer, each with a partial output (a call met its quota
    on a short group and interrupted them)."""
    groups = [spec("quick", 2)] + [spec(g, budget) for g in gids]
    await mgr.rollout(RolloutReq(groups=groups, target_groups=1, on_quota="tokens"))
    assert {e.group_id for e in mgr.buffer.idle.oldest()} == set(gids)

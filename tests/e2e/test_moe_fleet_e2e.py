"""Routing replay through an owner over two tiny-MoE engine servers (on this CPU).

Segments run on the engines; their routing crosses the owner/engine wire and is joined on the
owner exactly as on one server: a resume restored on the engine holding the snapshot keeps every
position's routing; a re-prefill (on whichever engine) flags exactly what it recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from april_client import routed_experts as decode
from tests.e2e.fleet import Fleet, cleared_owner
from tests.e2e.test_moe_routing_e2e import as_sample, interrupt, sglang_routing
from tests.e2e.test_rollouts_e2e import R, group, ok

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("april-moe-fleet"), ["--april-model", "tiny-moe"])
    yield f
    f.stop()


@pytest.fixture()
def http(fleet: Fleet) -> Iterator[httpx.Client]:
    with cleared_owner(fleet) as c:
        yield c


def engine(fleet: Fleet) -> httpx.Client:
    return fleet.engines[0].client()


def test_an_owner_returns_the_engines_routing(http: httpx.Client, fleet: Fleet) -> None:
    prompt, budget = [41, 42, 43, 44], 20
    with engine(fleet) as e:
        want_ids, want = sglang_routing(e, prompt, budget)
    body = {"groups": [group("o", prompt, [budget])], "return_routed_experts": True}
    s = as_sample(ok(http.post(R + "/rollouts", json=body))["groups"][0]["samples"][0])
    assert s.output_ids == want_ids and s.routing is not None
    assert (decode.experts(s.routing) == want).all()


@pytest.mark.parametrize("kv", ["restore", "recompute"])
def test_resume_through_the_owner_keeps_the_routing(
    http: httpx.Client, fleet: Fleet, kv: str
) -> None:
    prompt, budget = [51, 52, 53, 54, 55], 90
    with engine(fleet) as e:
        want_ids, want = sglang_routing(e, prompt, budget)
    s = interrupt(http, "f", prompt, budget, 6)
    assert s.routing is not None and s.snapshot_bytes > 0
    known = s.routing.num_positions
    for p in fleet.engines:  # only a snapshot (restore) or a full prefill can continue it
        with p.client() as c:
            assert c.post("/flush_cache").status_code == 200
    out = ok(http.post(R + "/resume", json={"sample_ids": ["f/0"], "kv": kv}))
    done = as_sample(out["samples"][0])
    assert done.output_ids == want_ids and done.routing is not None
    assert (decode.experts(done.routing) == want).all()
    _, mask = decode.recomputed(done.routing)
    last = done.segments[-1]
    if kv == "restore":
        assert last.kv == "restored" and last.engine == s.segments[-1].engine and not mask.any()
    else:
        assert last.kv == "recomputed"
        assert np.flatnonzero(mask).tolist() == list(range(known))

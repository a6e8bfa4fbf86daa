"""What a call works with, built once by the composition root (`root/manager.py`) and handed
to every call; each of the call's steps keeps only the parts it uses."""

from __future__ import annotations

from dataclasses import dataclass

from april_server.buffer.partial_buffer import PartialBuffer
from april_server.engine.base import BaseEngine
from april_server.engine.segment_planner import SegmentPlanner
from april_server.engine.segment_runner import SegmentRunner
from april_server.engine.segment_state import Counters
from april_server.engine.versions import WeightVersions
from april_server.rules.inflight import Admission
from april_server.rules.lengths import LengthModel
from april_server.rules.pool_size import PoolAdvisor
from april_server.runtime.background import Background
from april_server.runtime.inflight_policy import InflightPolicy
from april_server.runtime.live_calls import LiveCalls
from april_server.runtime.persister import Persister


@dataclass(frozen=True)
class CallParts:
    engine: BaseEngine  # checks a request's prompts and params; shows a turn as text
    buffer: PartialBuffer
    segments: SegmentRunner
    planner: SegmentPlanner  # the admission bound; whether snapshots are kept
    background: Background
    calls: LiveCalls
    persister: Persister
    versions: WeightVersions
    lengths: LengthModel  # predicted lengths: the order new groups start in, pool advice
    policy: InflightPolicy
    pool_advisor: PoolAdvisor
    admission: Admission
    counters: Counters

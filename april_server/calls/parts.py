"""What a call works with, built once by the composition root (`root/manager.py`) and handed to
every call, grouped by what each part is for; each of the call's steps keeps only the groups
it uses."""

from __future__ import annotations

from dataclasses import dataclass

from april_server.buffer.partial_buffer import PartialBuffer
from april_server.engine.base import BaseEngine
from april_server.engine.segment_planner import SegmentPlanner
from april_server.engine.segment_runner import SegmentRunner
from april_server.engine.segment_state import Counters
from april_server.engine.versions import WeightVersions
from april_server.rules.lengths import LengthModel
from april_server.runtime.background import Background
from april_server.runtime.live_calls import LiveCalls
from april_server.runtime.persister import Persister
from april_server.runtime.pool_sizing import PoolSizing


@dataclass(frozen=True)
class Holdings:
    """The groups and their store: who holds each (the holder map, the idle index) and the
    commit that makes an outcome durable before it is answered."""

    buffer: PartialBuffer
    persister: Persister


@dataclass(frozen=True)
class Generation:
    """What runs the segments: the runner (start, stop, record), its planner (the admission
    bound, whether snapshots are kept), the weight versions that stamp them, the counters."""

    segments: SegmentRunner
    planner: SegmentPlanner
    versions: WeightVersions
    counters: Counters


@dataclass(frozen=True)
class CallParts:
    engine: BaseEngine  # checks a request's prompts and params; shows a turn as text
    holdings: Holdings
    generation: Generation
    sizing: PoolSizing  # the running target, what fits beside what runs, the next pool's advice
    lengths: LengthModel  # predicted lengths: the order new groups start in
    background: Background  # gives way to the call; takes its stragglers
    calls: LiveCalls

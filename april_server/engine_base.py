"""What the rollout manager needs from an inference engine; `engine.py` is the SGLang one.

Tests plug in a fake with the same interface, so the bookkeeping is tested without SGLang.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from april_server.samples import SegmentResult


class BaseEngine(ABC):
    context_len: int
    vocab_size: int | None

    @abstractmethod
    def weight_version(self) -> str:
        """The version of the weights that new tokens are generated with."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`; raises ApiError(400) when the server has no tokenizer."""

    @abstractmethod
    def check_sampling_params(self, params: dict[str, Any]) -> None:
        """Raise ApiError(400) for sampling params the engine would reject."""

    @abstractmethod
    async def generate(
        self, rid: str, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> SegmentResult:
        """Generate one segment. An abort ends it early with finish_reason "abort" and the
        tokens produced so far (never an exception)."""

    @abstractmethod
    def abort(self, rid: str) -> None:
        """Ask the engine to stop `rid`. Fire and forget: a request the engine has not seen
        yet may miss it, so callers repeat until the generate call has returned."""

    def engine_stats(self) -> dict[str, Any]:
        """Engine-side figures for /stats (free KV tokens, running requests...)."""
        return {}

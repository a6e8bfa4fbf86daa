"""verl adapter (verl 0.9.1): an `LLMServerClient` for its agent loops, and a quota-level batch.

Two pieces, both driven by verl's own code (`verl/workers/rollout/llm_server.py`,
`verl/experimental/agent_loop/agent_loop.py`):

- `AprilLLMServerClient`: what an agent loop calls, `generate(request_id, *, prompt_ids,
  sampling_params, ...) -> TokenOutput`, served by april-server: each call is a group of one on
  `POST /april/v1/rollouts`. An interruption (a weight push cuts it at the version boundary)
  is continued by the server, so the loop never sees an abort and never re-sends its prompt and
  partial output (what `FullyAsyncLLMServerClient` does); `extra_fields` carries
  `global_steps`, `min_global_steps` and `max_global_steps` from the weight versions that
  sampled the tokens, where verl reads them.
- `AprilAgentLoopManager` (verl's `actor_rollout_ref.rollout.agent.agent_loop_manager_class`):
  where verl makes its batch (`generate_sequences`), one quota call: the step's prompts as
  groups of `rollout.n`, plus over-provisioned groups drawn from the training set, and exactly
  as many finished groups back as the step asked for; stragglers stay on the server and are
  served first at the next step (`verl_batch.py`).

Settings: `config.april` (`+april.url=...`, `+april.over_provision=2`, `+april.max_staleness=1`,
`+april.stale_tokens=mask|keep`, `+april.sampling.stop_token_ids=[...]`), or the
`APRIL_SERVER_URL` environment variable for the URL.
Weights: `AprilCheckpointEngine` (`verl_weights.py`) is a verl checkpoint-engine backend
(`checkpoint_engine.backend=april`, `custom_backend_module=april_client.verl_weights`) whose
`send_weights(weights, global_steps)` pushes verl's per-tensor weights to the server over a
torch.distributed group (or from disk) as weight version `str(global_steps)`.

verl is imported when first used (`_framework.py`); the manager class is built on first access.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from ._async import AsyncAprilClient
from ._framework import framework
from .protocol import Sample
from .trainer_batch import response_logprobs

URL_ENV = "APRIL_SERVER_URL"
CALL_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class AprilSettings:
    """The adapter's settings, from `config.april` (all optional but the URL)."""

    url: str
    over_provision: float = 1.0
    max_staleness: int | None = None
    stale_tokens: Literal["mask", "keep"] = "keep"
    max_inflight_groups: int | Literal["auto"] = "auto"
    seed: int = 0
    # Merged into every group's sampling params, e.g. {"stop_token_ids": [...]}: verl's rollout
    # config has no field for stops.
    sampling: dict[str, Any] = field(default_factory=dict)


def plain(value: Any) -> Any:
    """An OmegaConf node (DictConfig, ListConfig) as plain dicts and lists."""
    if hasattr(value, "items"):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        return value
    return [plain(v) for v in value]


def settings(config: Any) -> AprilSettings:
    april = plain(config.get("april") or {}) if config is not None else {}
    url = april.pop("url", None) or os.environ.get(URL_ENV)
    if not url:
        raise ValueError(
            f"april_client.verl needs the server's address: +april.url=http://host:port in the "
            f"trainer config, or {URL_ENV}"
        )
    out = AprilSettings(url=str(url), **april)
    if out.over_provision < 1.0:
        raise ValueError(f"april.over_provision must be >= 1.0, got {out.over_provision}")
    if out.stale_tokens not in ("mask", "keep"):
        raise ValueError(f"april.stale_tokens must be 'mask' or 'keep', got {out.stale_tokens!r}")
    return out


def version_steps(sample: Sample) -> tuple[int | None, int | None, int | None]:
    """(newest, oldest, newest) weight version of the sample's segments as verl's global steps
    (None where a version is not a step number, e.g. the server's initial `default`)."""
    steps = []
    for seg in sample.segments:
        try:
            steps.append(int(seg.weight_version))
        except ValueError:
            continue
    if not steps:
        return None, None, None
    return steps[-1], min(steps), max(steps)


def server_sampling_params(
    sampling_params: dict[str, Any], prompt_len: int, rollout: Any | None
) -> dict[str, Any]:
    """verl's per-request sampling params as the server takes them: `max_tokens` (vLLM's
    name) becomes `max_new_tokens`; without either, verl's own default budget (its SGLang
    server's): the response length, within the context left by the prompt."""
    params = dict(sampling_params)
    params.pop("logprobs", None)  # the server always returns the sampling logprobs
    if "max_new_tokens" not in params:
        if "max_tokens" in params:
            params["max_new_tokens"] = params.pop("max_tokens")
        elif rollout is not None:
            params["max_new_tokens"] = response_budget(rollout, prompt_len)
    return {k: v for k, v in params.items() if v is not None}


def response_budget(rollout: Any, prompt_len: int) -> int:
    """verl's default budget (its SGLang server's): the response length, within the context
    the prompt leaves (`prompt_length + response_length` in all)."""
    return min(
        int(rollout.response_length),
        int(rollout.prompt_length) + int(rollout.response_length) - prompt_len,
    )


class AprilLLMServerClient:
    """An `LLMServerClient` (verl's agent-loop client) backed by april-server."""

    def __init__(
        self,
        config: Any = None,
        load_balancer_handle: Any = None,
        *,
        url: str | None = None,
        client: AsyncAprilClient | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = config
        self.url = url or settings(config).url
        self._client = client
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self.calls = 0

    @property
    def client(self) -> AsyncAprilClient:
        # One per event loop: verl builds the client in one place and runs agent loops in
        # another loop (a Ray actor's, or a fresh one per call without Ray).
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = AsyncAprilClient(self.url, timeout=CALL_TIMEOUT_S)
            self._loop = loop
        return self._client

    def _rollout_config(self) -> Any:
        try:
            return self.config.actor_rollout_ref.rollout
        except AttributeError:
            return None

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        audio_data: Any = None,
        mm_processor_kwargs: Any = None,
        **kwargs: Any,
    ) -> Any:
        """One generation, as verl's `LLMServerClient.generate` (its other keyword arguments,
        e.g. `priority`, are accepted and not used)."""
        replica = framework("verl.workers.rollout.replica")
        if image_data or video_data or audio_data:
            raise ValueError("april_client.verl generates from token ids: no multimodal inputs")
        ids = [int(t) for t in prompt_ids]
        params = server_sampling_params(sampling_params, len(ids), self._rollout_config())
        group_id = f"verl-{request_id}.{next(self._ids)}"
        spec = {"group_id": group_id, "n": 1, "input_ids": ids, "sampling_params": params}
        resp = await self.client.rollout(
            [spec], 1, resume_first=False, on_quota="snapshot", request_id=group_id
        )
        self.calls += 1
        (sample,) = resp.groups[0].samples
        newest, oldest, latest = version_steps(sample)
        return replica.TokenOutput(
            token_ids=list(sample.output_ids),
            log_probs=response_logprobs(sample),
            stop_reason="completed",
            num_preempted=max(0, len(sample.segments) - 1),
            extra_fields={
                "global_steps": newest,
                "min_global_steps": oldest,
                "max_global_steps": latest,
                "april_sample_id": sample.sample_id,
            },
        )


def __getattr__(name: str) -> Any:
    """`AprilAgentLoopManager`: a subclass of verl's `AgentLoopManager`, built on first access
    (verl's `load_class_from_fqn` reads it as an attribute of this module)."""
    if name == "AprilAgentLoopManager":
        from .verl_batch import manager_class

        return manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

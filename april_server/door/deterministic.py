"""`--enable-deterministic-inference` on a CPU-only machine, through SGLang's extension points.

SGLang's deterministic mode is what makes `sampling_seed` count: the Gumbel noise of each token
is a hash of (seed, absolute position, token id) (`layers/sampler.py: multinomial_with_seed`),
so a request resumed by re-prefilling `prompt + output[:c]` draws exactly the noise of the
original step c. As shipped it does not start on CPU; three things stand in the way:

1. Server-argument resolution rejects `torch_native` attention, the one backend that runs on
   CPU (ValueError from `arg_groups/overrides.py: _deterministic_attention_backend`). SGLang's
   seam for out-of-tree platforms, `add_deterministic_attention_backend_choices`, allows it.
   torch_native attends one request at a time (SDPA), so its result does not depend on the
   batch. It stays out of the radix-compatible list, so SGLang disables the prefix cache in
   this mode by itself (a prefix hit would replace the re-prefill by KV of another origin).
2. `ModelRunner.maybe_enable_batch_invariant_mode` installs SGLang's Triton matmul /
   log_softmax / mean kernels as the aten implementations for the accelerator's dispatch key;
   on CPU `get_dispatch_device_backend()` raises "No supported accelerator (CUDA/XPU)
   available", and there is no Triton driver to run them. An AROUND hook skips it on a CPU
   model runner: aten's CPU kernels stay, so logits are reproducible run to run but not
   batch-invariant in the last bits (a re-prefilled token's logprobs differ from the decoded
   one's by ~5e-7 in fp32). A seeded sample then flips only where two tokens' noisy scores are
   that close: a genuine near-tie (tests/e2e/test_seeded_e2e.py checks exactly that).
3. The hash: `murmur_hash32` calls `torch.ops.sgl_kernel.murmur_hash32_cpu` for CPU tensors;
   april-server's CPU `sgl_kernel` shim defines it in torch, bit-identical to SGLang's C++ CPU
   kernel and its Triton kernel (april_server/cpu_shim/sgl_kernel).

One more hook makes a seeded token independent of the rest of the batch, which resumption needs
(a sample resumes next to other requests than it started with). SGLang picks the sampling path
per *batch*: `simple_sampling_case` is false as soon as any request in the batch is greedy or
uses top-k / top-p / min-p, and that filtered path draws the noise by *rank* in the sorted
distribution instead of by token id. So a plain seeded request drew other tokens when a greedy
request shared its batch (measured: from its second token on).
4. An AROUND hook on `Sampler._sample_from_probs` samples the plain rows of such a batch as
   they are sampled alone (`sampling_from_probs_torch`: noise by token id); filtered rows keep
   SGLang's result, so every row's token depends on its own parameters, seed and position only.

5. An AFTER hook on `SamplingParams.verify` rejects `min_p > 0` in this mode (a 400 from
   /generate and from april's routes): every request carries a seed there (SGLang defaults it
   to 42), and SGLang's seeded filtered sampler asserts `sampling_seed is None` when min-p is
   on ("With sampling seed, multinomial_with_seed will provide wrong results"), which killed
   the scheduler, i.e. the whole server, on the first such request.

All of it is registered only on SGLang's CPU engine, and acts only in deterministic mode: 1
widens a list consulted in that mode only, 2 and 5 check it, 4 needs batch seeds, which only
that mode sets. So `register_deterministic_hooks()` is called from every process, always; on a GPU
machine it does nothing and SGLang's own deterministic path is untouched.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

CPU_DETERMINISTIC_ATTENTION_BACKENDS = ["torch_native"]
_registered = False


def cpu_engine() -> bool:
    """SGLang's CPU engine is selected by this variable (`april-server` sets it without CUDA)."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE", "").strip().lower() in ("1", "true", "yes")


def register_deterministic_hooks() -> None:
    """Make `--enable-deterministic-inference` start and run on SGLang's CPU engine."""
    global _registered
    if _registered or not cpu_engine():
        return
    _registered = True
    from sglang.srt.arg_groups.choices import (
        DETERMINISTIC_ATTENTION_BACKEND_CHOICES,
        add_deterministic_attention_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    missing = [
        b
        for b in CPU_DETERMINISTIC_ATTENTION_BACKENDS
        if b not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES
    ]
    if missing:
        add_deterministic_attention_backend_choices(missing)
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.maybe_enable_batch_invariant_mode",
        _around_batch_invariant_mode,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.layers.sampler.Sampler._sample_from_probs",
        _around_sample_from_probs,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.sampling.sampling_params.SamplingParams.verify",
        _after_verify,
        HookType.AFTER,
    )


def deterministic_enabled() -> bool:
    from sglang.srt.runtime_context import get_exec

    try:
        return bool(get_exec().deterministic.enable_deterministic_inference)
    except ValueError:  # not published in this process: resolution exported it to the env
        from sglang.srt.environ import envs

        return bool(envs.SGLANG_ENABLE_DETERMINISTIC_INFERENCE.get())


def _after_verify(result: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
    if params.min_p > 0 and deterministic_enabled():
        raise ValueError(
            "min_p is not supported with --enable-deterministic-inference (SGLang's seeded "
            "sampler cannot apply it)"
        )
    return result


def _around_batch_invariant_mode(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    if str(getattr(runner, "device", "")).startswith("cpu") and deterministic_enabled():
        logger.warning(
            "april: deterministic inference on CPU: SGLang's Triton batch-invariant kernels are "
            "skipped; aten's CPU kernels stay (seeded sampling stays reproducible)"
        )
        return None
    return original(runner, *args, **kwargs)


def plain_rows(sampling_info: Any) -> torch.Tensor:
    """Rows SGLang samples on its simple path when they are alone in a batch: the whole
    vocabulary, no top-k (greedy is top_k 1), top-p or min-p (`SamplingBatchInfo`'s flags)."""
    from sglang.srt.sampling.sampling_params import TOP_K_ALL

    plain: torch.Tensor = (
        (sampling_info.top_ks == TOP_K_ALL)
        & (sampling_info.top_ps == 1.0)
        & (sampling_info.min_ps <= 0.0)
    )
    return plain


def _around_sample_from_probs(
    original: Any,
    sampler: Any,
    probs: torch.Tensor,
    sampling_info: Any,
    positions: torch.Tensor,
    simple_sampling_case: bool,
    *args: Any,
    **kwargs: Any,
) -> Any:
    def call() -> Any:
        return original(
            sampler, probs, sampling_info, positions, simple_sampling_case, *args, **kwargs
        )

    seeds = sampling_info.sampling_seed
    if simple_sampling_case or seeds is None:
        return call()
    if sampling_info.sampling_mask_batch_indices is not None:
        return call()  # the sampling-mask capture describes SGLang's own choice: leave it whole
    plain = plain_rows(sampling_info)
    if not bool(plain.any()):
        return call()
    from sglang.srt.layers.sampler import sampling_from_probs_torch

    rows = plain.nonzero().view(-1)
    # Taken before the original runs: it may modify `probs` in place.
    alone = sampling_from_probs_torch(
        probs.index_select(0, rows), seeds.index_select(0, rows), positions.index_select(0, rows)
    )
    ids, capture = call()
    ids = ids.clone()
    ids[rows] = alone.to(ids.dtype)
    return ids, capture

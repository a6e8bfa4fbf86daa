"""`--enable-deterministic-inference` on a CPU-only machine, through SGLang's extension points.

SGLang's deterministic mode is what makes `sampling_seed` count: the Gumbel noise of each token
is a hash of (seed, absolute position, token id) (`layers/sampler.py: multinomial_with_seed`),
so a request resumed by re-prefilling `prompt + output[:c]` draws exactly the noise of the
original step c. As shipped it does not start on CPU; three things stand in the way:

1. Server-argument resolution rejects `torch_native` attention (ValueError from
   `arg_groups/overrides.py: _deterministic_attention_backend`, the only backend that runs on
   CPU). SGLang's own seam for out-of-tree platforms, `add_deterministic_attention_backend_
   choices`, declares it allowed. torch_native attends one request at a time with SDPA, so its
   result does not depend on the batch. It stays out of the radix-compatible list, so SGLang
   disables the prefix cache in this mode (a prefix-cache hit would skip the re-prefill whose
   bits we rely on only approximately anyway).
2. `ModelRunner.maybe_enable_batch_invariant_mode` registers SGLang's Triton matmul /
   log_softmax / mean kernels as the aten implementations for the accelerator's dispatch key;
   on CPU `get_dispatch_device_backend()` raises "No supported accelerator (CUDA/XPU)
   available" and there are no Triton kernels to run. An AROUND hook skips it on a CPU model
   runner: aten's CPU kernels stay, so logits are reproducible for the same batch shapes but not
   batch-invariant in the last bits (prefill vs decode of the same token differs by ~5e-7 in
   fp32). Sampling flips only at genuine near-ties of the noisy scores (tests/e2e/
   test_seeded_e2e.py checks exactly that).
3. The hash itself: `murmur_hash32` calls `torch.ops.sgl_kernel.murmur_hash32_cpu` for CPU
   tensors. april-server's CPU `sgl_kernel` shim defines it in torch, bit-identical to the C++
   CPU kernel and the Triton kernel (april_server/cpu_shim/sgl_kernel).

Everything here is a no-op unless the process runs SGLang's CPU engine, and the hook of 2 only
acts when deterministic inference is enabled; 1 only widens a list consulted in that mode. So
`register_deterministic_hooks()` is safe to call from every process, always: on a GPU machine it
does nothing and SGLang's own deterministic path is untouched.
"""

from __future__ import annotations

import logging
import os
from typing import Any

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
        b for b in CPU_DETERMINISTIC_ATTENTION_BACKENDS
        if b not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES
    ]  # fmt: skip
    if missing:
        add_deterministic_attention_backend_choices(missing)
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.maybe_enable_batch_invariant_mode",
        _around_batch_invariant_mode,
        HookType.AROUND,
    )


def deterministic_enabled() -> bool:
    from sglang.srt.runtime_context import get_exec

    try:
        return bool(get_exec().deterministic.enable_deterministic_inference)
    except ValueError:  # no published config (bare construction)
        return False


def _around_batch_invariant_mode(original: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    if str(getattr(runner, "device", "")).startswith("cpu") and deterministic_enabled():
        logger.warning(
            "april: deterministic inference on CPU: SGLang's Triton batch-invariant kernels are "
            "skipped (aten CPU kernels stay; seeded sampling stays reproducible)"
        )
        return None
    return original(runner, *args, **kwargs)

"""Routed-experts capture (`--enable-return-routed-experts`) on SGLang's CPU engine.

SGLang 0.5.23 runs a mixture-of-experts layer on CPU without the sgl-kernel CPU build: without
AMX, `UnquantizedFusedMoEMethod.forward_cpu` calls the torch-native `moe_forward_native` and the
router's top-k is plain torch (`fused_topk_torch_native`). What does not start is the capture of
the routed experts: its host buffer (`state_capturer/base.py: BaseHostCache`) is allocated with
`pin_memory=True` through `pool_host/common.alloc_with_host_register`, which calls
`_cuda_host_register` -> `torch.cuda.cudart()`; without CUDA that raises (in a forked scheduler:
"Cannot re-initialize CUDA in forked subprocess"), and the scheduler dies at start-up.

One AROUND hook on `_cuda_host_register` skips the registration when CUDA is absent: pinning
host memory only speeds up copies to and from a GPU, and there is none. Registered only on
SGLang's CPU engine, so a GPU machine keeps SGLang's path untouched.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from april_server.door.deterministic import cpu_engine

logger = logging.getLogger(__name__)

HOST_REGISTER = "sglang.srt.mem_cache.pool_host.common._cuda_host_register"
_registered = False


def register_moe_hooks() -> None:
    """Let the routed-experts capturer allocate its host buffer on a machine without CUDA."""
    global _registered
    if _registered or not cpu_engine():
        return
    _registered = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOST_REGISTER, _around_host_register, HookType.AROUND)


def _around_host_register(original: Any, buffer: Any, *args: Any, **kwargs: Any) -> Any:
    if torch.cuda.is_available():
        return original(buffer, *args, **kwargs)
    return None  # nothing to register host memory with: the buffer stays plain pageable


# ---- routing beside a KV snapshot ------------------------------------------------------------
# SGLang's capturer keeps the experts of every token in a host buffer indexed by KV slot
# (`host_cache.buffer[slot] = [layers, top_k]`, written at each forward) and answers a request
# from the slots of its prefix. A restored snapshot gets new slots, whose rows hold whatever
# token used them last; so a snapshot keeps its tokens' rows, and a restore writes them back
# under the new slots: a later request matching the restored prefix (the continuation, a
# sibling with the same prompt) is answered the routing that computed that KV.


def _capturer() -> Any:
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    try:
        return get_global_experts_capturer()
    except Exception:  # no runtime context in this process: nothing is captured here
        return None


def saved_routing(slots: torch.Tensor) -> torch.Tensor | None:
    """A host copy of the capture rows of `slots` ([n] int64 KV slots); None without capture."""
    cap = _capturer()
    if cap is None or getattr(cap.host_cache, "buffer", None) is None:
        return None
    rows: torch.Tensor = cap.host_cache.buffer[slots.cpu()].clone()
    return rows  # [n, num_moe_layers, top_k] int32


def restore_routing(slots: torch.Tensor, routing: torch.Tensor | None, n: int) -> None:
    """Write a snapshot's first `n` capture rows under the slots its KV was restored into."""
    cap = _capturer()
    if cap is None or routing is None or getattr(cap.host_cache, "buffer", None) is None:
        return
    cap.host_cache.buffer[slots[:n].cpu()] = routing[:n]

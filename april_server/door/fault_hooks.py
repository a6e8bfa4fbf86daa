"""Fault injection for end-to-end tests: an abort that lands in a chosen decode step.

Off unless the server starts with `APRIL_FAULT_INJECTION=1` (the test suite's shared server
does; a production server never registers the hook). Then a request whose sampling params
carry `custom_params: {"april_abort_at_output_len": N}` is aborted in the step that produced
its N-th output token, exactly as an `abort_request` that arrives during that step: SGLang's
`Req.update_finish_state` takes `to_finish` before it looks at stop tokens or strings, so the
request ends `abort` even when that token ended a stop: the race `rules/stops.py` reads through,
made deterministic so a test can hit it every time.
Hook: AROUND `schedule_batch.Req.update_finish_state`.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "APRIL_FAULT_INJECTION"
ABORT_AT = "april_abort_at_output_len"


def register_fault_hooks() -> None:
    if os.environ.get(ENV) != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.Req.update_finish_state",
        _around_update_finish_state,
        HookType.AROUND,
    )


def _around_update_finish_state(original: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    at = (getattr(req.sampling_params, "custom_params", None) or {}).get(ABORT_AT)
    if at is not None and req.to_finish is None and not req.finished():
        if len(req.output_ids) == int(at):
            from sglang.srt.managers.schedule_batch import FINISH_ABORT

            req.to_finish = FINISH_ABORT(f"april fault injection: abort at output {at}")
    return original(req, *args, **kwargs)

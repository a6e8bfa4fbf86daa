"""How a segment ended, read from what it produced. Pure: no I/O, no SGLang.

SGLang names a request's end by why it stopped, and an abort wins over everything else in its
step (`Req.update_finish_state` looks at `to_finish` first): when a call's quota, an `/abort`,
a weight update's cut or the background's pause lands in the very step that produced a stop
token, EOS or the end of a stop string, the request says `abort` although its output ended at
that stop. Recorded as an interruption, the member would later continue past its stop: a turn
stop silently merged into one long turn, or a finished answer extended. So a segment that
ended by abort is classified again by its output: if its last token ended a stop (the
segment's own stop token ids and EOS, unless `ignore_eos`; a stop string whose text first
appears with that token), it ended by that stop, exactly as SGLang would have said a step
earlier.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

STOP_TEXT_SLACK = 8  # tokens beyond one per character of the longest stop string


def stop_strings(params: dict[str, Any]) -> list[str]:
    own = params.get("stop") or []
    return [own] if isinstance(own, str) else [s for s in own if s]


def reached_stop(
    params: dict[str, Any],
    before: list[int],
    new: list[int],
    eos_ids: Collection[int],
    detokenize: Callable[[list[int]], str | None],
) -> str | int | None:
    """The stop that the last of `new` (a segment's output, after `before`: the output of the
    turn so far) completed, if any; `params`: the segment's sampling params."""
    if not new:
        return None
    last = new[-1]
    if not params.get("ignore_eos") and (
        last in (params.get("stop_token_ids") or ()) or last in eos_ids
    ):
        return last
    stops = stop_strings(params)
    if not stops:
        return None
    window = (before + new)[-(max(len(s) for s in stops) + STOP_TEXT_SLACK) :]
    text, earlier = detokenize(window), detokenize(window[:-1])
    if text is None or earlier is None:  # no tokenizer: SGLang could not match text either
        return None
    for s in stops:
        if s in text and s not in earlier:
            return s
    return None

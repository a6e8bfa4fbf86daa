"""Drafts from history, a finished research spike: how many tokens would an n-gram draft taken
from earlier rollouts of the same prompt get accepted, measured offline on real samples.

Why offline: SGLang 0.5.23's speculative decoding (NGRAM included) does not start on our CPU
setup (its CPU path takes the tree kernels from sgl-kernel's CPU build, which has no wheel here;
docs/benchmarks.md). The acceptance itself needs no engine: a draft taken from history is fixed
before the sample draws its token, and speculative sampling accepts a fixed draft token x with
probability p(x) — the very probability that the sampled token *is* x. So the number of
leading draft tokens a real temperature-1 sample reproduces is an unbiased sample of how many a
verifier would accept. Each verify step then yields accepted + 1 tokens.

The drafter is prompt lookup / SGLang's NGRAM in miniature: the longest suffix of the context
(up to `max_n` tokens, at least `min_n`) found in the reference sequences, its most recent
occurrence, and the `depth` tokens that followed it. Sources compared: `self` (the prompt and
the sample's own output so far: prompt lookup, no history), `history` (earlier rollouts of the
same prompt, from earlier steps), `history+self`.

    python -m examples.drafts [--prompts 8] [--n 4] [--epochs 3] [--max-tokens 192]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

Ngram = tuple[int, ...]


@dataclass
class NgramIndex:
    """Where each n-gram (min_n..max_n tokens) ends in a set of sequences; the newest wins."""

    min_n: int = 1
    max_n: int = 4
    seqs: list[list[int]] = field(default_factory=list)
    last: dict[Ngram, tuple[int, int]] = field(default_factory=dict)  # -> (seq, end position)

    def add(self, seq: Sequence[int]) -> int:
        """Index a whole sequence; returns its id (so it can grow with `extend`)."""
        self.seqs.append([])
        sid = len(self.seqs) - 1
        self.extend(sid, seq)
        return sid

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        """Append tokens; an n-gram is indexed once a token follows it (the context's own
        tail, with nothing after it yet, is no draft)."""
        s = self.seqs[sid]
        for t in tokens:
            i = len(s)  # where `t` lands: the n-grams ending just before it now have a follower
            s.append(t)
            for n in range(self.min_n, min(self.max_n, i) + 1):
                self.last[tuple(s[i - n : i])] = (sid, i)

    def draft(self, context: Sequence[int], depth: int) -> list[int]:
        """The tokens that followed the longest indexed suffix of `context` (at most `depth`)."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            hit = self.last.get(tuple(context[len(context) - n :]))
            if hit is not None:
                sid, end = hit
                follow = self.seqs[sid][end : end + depth]
                if follow:
                    return follow
        return []


@dataclass(frozen=True)
class DraftRun:
    tokens: int  # output tokens of the sample
    verify_steps: int  # forwards a speculative decoder would have run
    drafted: int  # draft tokens proposed
    accepted: int  # of which accepted


def simulate(
    prompt: Sequence[int],
    output: Sequence[int],
    references: Sequence[Sequence[int]],
    use_self: bool,
    depth: int = 4,
) -> DraftRun:
    """Replay `output` under n-gram drafting from `references` (and, with `use_self`, the
    prompt and the output so far): each verify step accepts the matching prefix of the draft
    and adds one token of its own."""
    index = NgramIndex()
    for ref in references:
        index.add(ref)
    own = index.add(list(prompt)) if use_self else None
    context = list(prompt)
    t = steps = drafted = accepted = 0
    while t < len(output):
        draft = index.draft(context, depth)
        a = 0
        while a < len(draft) and t + a < len(output) and draft[a] == output[t + a]:
            a += 1
        step = list(output[t : t + a + 1])
        drafted, accepted, steps = drafted + len(draft), accepted + a, steps + 1
        context += step
        if own is not None:
            index.extend(own, step)
        t += len(step)
    return DraftRun(len(output), steps, drafted, accepted)


SOURCES = ("self", "history", "history+self")


def evaluate(samples: Sequence[dict[str, Any]], depth: int = 4) -> dict[str, dict[str, float]]:
    """`samples`: {"prompt": key, "epoch": e, "prompt_ids", "output_ids"}, in any order. A
    sample's history is every output of the same prompt from earlier epochs."""
    out: dict[str, dict[str, float]] = {}
    for source in SOURCES:
        runs = []
        for s in samples:
            history = [
                h["output_ids"]
                for h in samples
                if h["prompt"] == s["prompt"] and h["epoch"] < s["epoch"]
            ]
            if not history:
                continue  # first epoch: every source is judged on the same later samples
            refs = history if source != "self" else []
            runs.append(
                simulate(s["prompt_ids"], s["output_ids"], refs, source != "history", depth)
            )
        tokens = sum(r.tokens for r in runs)
        steps = sum(r.verify_steps for r in runs)
        drafted = sum(r.drafted for r in runs)
        out[source] = {
            "samples": len(runs),
            "tokens": tokens,
            "acceptance": round(sum(r.accepted for r in runs) / drafted, 3) if drafted else 0.0,
            "tokens_per_verify_step": round(tokens / steps, 3) if steps else 0.0,
            "median_sample_tokens_per_step": round(
                statistics.median(r.tokens / r.verify_steps for r in runs), 3
            )
            if runs
            else 0.0,
        }
    return out


def collect(
    url: str, prompts: int, n: int, epochs: int, max_tokens: int, seed: int
) -> list[dict[str, Any]]:
    """Run `epochs` passes over the text workload's prompts (each a whole group of `n`, every
    group finished: a synchronous step per epoch) and return every sample's tokens."""
    from april_bench.workload import Workload

    wl = Workload("text", n, max_tokens, seed=seed, prompts=prompts)
    samples: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, timeout=3600) as c:
        for epoch in range(epochs):
            groups = [wl.group(epoch * prompts + i) for i in range(prompts)]
            body = {
                "groups": [
                    {
                        "group_id": f"drafts-e{epoch}-p{i}",
                        "text": g.text,
                        "n": n,
                        "sampling_params": g.sampling_params(max_tokens, 1.0),
                    }
                    for i, g in enumerate(groups)
                ],
                "target_groups": prompts,
                "resume_first": False,
            }
            r = c.post("/april/v1/rollouts", json=body)
            r.raise_for_status()
            for g in r.json()["groups"]:
                p = int(g["group_id"].rsplit("-p", 1)[1])
                for s in g["samples"]:
                    samples.append(
                        {
                            "prompt": p,
                            "epoch": epoch,
                            "prompt_ids": s["prompt_ids"],
                            "output_ids": s["output_ids"],
                        }
                    )
            print(f"epoch {epoch + 1}/{epochs}: {len(groups) * n} samples", flush=True)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="an april-server with SmolLM2 (default: launch one)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--depth", type=int, default=4, help="draft tokens per verify step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.url:
        samples = collect(args.url, args.prompts, args.n, args.epochs, args.max_tokens, args.seed)
    else:
        from april_server.launcher import LaunchedServer

        with LaunchedServer(["--april-model", "smollm2"]) as srv:
            samples = collect(
                srv.url, args.prompts, args.n, args.epochs, args.max_tokens, args.seed
            )
    figures = evaluate(samples, args.depth)
    print(
        f"\n{len(samples)} samples, {args.prompts} prompts x {args.n} x {args.epochs} epochs, "
        f"max {args.max_tokens} tokens, draft depth {args.depth}"
    )
    print(
        f"{'source':>14}  {'samples':>7}  {'acceptance':>10}  {'tokens/verify step':>18}  "
        f"{'median per sample':>17}"
    )
    for source, f in figures.items():
        per_step, median = f["tokens_per_verify_step"], f["median_sample_tokens_per_step"]
        print(
            f"{source:>14}  {f['samples']:>7}  {f['acceptance']:>10.3f}  {per_step:>18.3f}  "
            f"{median:>17.3f}"
        )


if __name__ == "__main__":
    main()

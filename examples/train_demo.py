"""`make train-demo`: TRL's GRPOTrainer on april-server: sync vs APRIL vs APRIL + background.

Each mode gets its own april-server (embedded tiny model, CPU) and a fresh copy of the same
initial policy; the trainer drives it through `april_client.trl.AprilRollout`:

- `sync`: every step sends its own prompts and waits for all of them (no over-provisioning,
  nothing buffered): what a trainer does on a stock server;
- `april`: `over_provision` times more groups in play, the step returns as soon as its quota of
  groups has finished, the rest continues in a later step;
- `april-async`: `april` plus `background=True` (issue 19): each call's stragglers keep
  generating while the trainer computes the loss, steps and pushes weights (`on_quota:
  continue`), and the adapter prefetches the groups the next call would draw. It runs with
  `max_inflight_groups` = the step's P groups: the buffered (older) groups start first and new
  ones fill in as groups finish (with `"auto"`, 2P at once, more samples went past
  `max_staleness` and restarted from their prompt; docs/trainers.md has the runs).

Tokens sampled under older weights (most of the APRIL modes' tokens) are trained with
`stale_tokens="correct"`: TRL's ratio is taken against the policy that sampled them
(`--stale-tokens keep` trains them as if fresh, `mask` gives them no loss). The loss is TRL's
`cispo` (every mode alike): the ratio is an importance weight, capped at 5 and kept out of the
gradient, so every token keeps its gradient. TRL's default (`--loss-type dapo`, PPO's clip at
1 +- 0.2) gives no gradient at all to a token whose ratio has left the band in the direction
its advantage pushes, and a token sampled one or two pushes ago is the one most likely to
have left it: with it, april-async learned about 0.6-0.8x as much per step as sync, which ate
its 1.5-1.8x step rate (docs/trainers.md, "The loss: why cispo"). ScaleRL (arXiv 2510.13786),
a recipe that trains off-policy (PipelineRL), uses CISPO; TRL's docs give 5 as its cap.

The defaults, and why (docs/trainers.md has every run behind them):
- 16 prompts x 4 answers per step: training time grows with the batch and the rollout less
  (batched decoding), so sync's training phase is about 0.6 of its rollout (0.45 with 8
  prompts): closer to the trainer on its own devices, about as slow as the rollout, that
  background generation is for;
- learning rate 3e-3, constant: at 1e-2 the policy moved so far per step that 13-15 % of the
  stale tokens fell outside the clip band (5-7 % at 3e-3), and `correct` learned slower than
  `keep`; 60 steps give sync's reward time to rise at the lower rate;
- `max_staleness` 3 for every mode: a background sample is judged by its oldest token, so it
  must be generated within max_staleness + 1 rollout calls and the training phases between
  them, or it restarts from its prompt at a push; with 2, this task's longest answers
  restarted 220-272 times per run, with 3, 8-44 times. April's calls judge a buffered sample
  by its newest segment, so for `april` the bound changes little.

Separate devices, on one machine: every mode runs the server pinned to core 1 and the trainer
to core 0 (one torch thread), so generation and training overlap as they would on a rollout
device beside a training device instead of competing for the same cores (`--no-pin` turns it
off, and it is off where cores 0 and 1 are not both available). The workload has a long tail of
lengths: each prompt's answer budget is drawn from a Pareto distribution (`train_task`), sent
as its group's `max_new_tokens`.

Equal time, not equal steps: sync trains `--steps` steps and the APRIL modes train as long as
sync did (whole steps, the one crossing it included, at most 4x the steps): what a user with a
time budget sees, and the fair reading of "reaches sync's final reward sooner" (with equal
steps a faster mode stops sooner, with fewer seconds of training; `--same-steps` runs that).
The demo's own instrumentation (one /stats read per step) is taken off the clock.

Writes `out/train.jsonl` (one row per mode and step: `mode`, `step`, `wall_s` cumulative from
the start of training, `reward_mean`, `rollout_s` (the step's wait for its rollout call),
`train_s` (the rest of the step: loss, optimizer, weight push, prefetch), `push_s` (the part of
`train_s` spent saving the weights and pushing them), plus the rollout's own
figures) and a plot of reward vs wall-clock seconds. The table gives per mode the mean split
of a step between rollout and training and the wall time to reach sync's final reward, then
each step's split. Wall-clock excludes server start and one warm-up rollout, the same for all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, get_args

from april_client.trainer_batch import StaleTokens
from april_server.launcher import LaunchedServer
from examples.train_report import by_seed, plot, seeds_table, split_table, summarize, table

MODES = ("sync", "april", "april-async")
TRAINER_CPU, SERVER_CPU = 0, 1


@dataclass(frozen=True)
class DemoConfig:
    steps: int = 60  # sync's; the APRIL modes train as long as sync did (`--same-steps`: 60)
    prompts_per_step: int = 16
    num_generations: int = 4
    max_completion_length: int = 256
    learning_rate: float = 3e-3
    over_provision: float = 2.0
    max_staleness: int = 3  # see the module docstring
    stale_tokens: StaleTokens = "correct"  # see the module docstring
    loss_type: str = "cispo"  # see the module docstring and LOSS_TYPES
    seed: int = 0
    pin: bool = True  # server and trainer on separate cores (see the module docstring)
    # Train for this many seconds of wall time (whole steps, at most WALL_STEPS_CAP x `steps`)
    # instead of `steps` steps: the APRIL modes get sync's time (unless `--same-steps`).
    wall_budget_s: float | None = None


WALL_STEPS_CAP = 4
# TRL loss types the demo offers, with the `epsilon_high` each runs with: "dapo" is TRL's
# default (PPO's clipped ratio, 1 +- 0.2); "cispo" caps the importance weight instead and
# keeps every token's gradient, at ScaleRL's recommended 5.0 (TRL's GRPOConfig docs).
LOSS_TYPES = {"dapo": None, "cispo": 5.0}


def run_mode(mode: str, cfg: DemoConfig, server_args: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Train `cfg.steps` optimizer steps in `mode` against a private server; one row per step."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging as hf_logging
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    from april_client import AprilClient
    from april_client.trl import AprilRollout
    from april_server.models import ensure_tiny_model
    from examples import train_task

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # one bar per weight push
    model_path = ensure_tiny_model()
    pin = cfg.pin and {TRAINER_CPU, SERVER_CPU} <= os.sched_getaffinity(0)
    server = LaunchedServer(list(server_args), cpus=[SERVER_CPU] if pin else None)
    server.start()
    rows: list[dict[str, Any]] = []
    own_cpus = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    if pin:
        os.sched_setaffinity(0, {TRAINER_CPU})
        torch.set_num_threads(1)
    try:
        client = AprilClient(server.url, timeout=900)
        adapter = AprilRollout(
            client,
            over_provision=cfg.over_provision if mode != "sync" else 1.0,
            max_staleness=cfg.max_staleness,
            stale_tokens=cfg.stale_tokens,
            background=mode == "april-async",
            max_inflight_groups=cfg.prompts_per_step if mode == "april-async" else "auto",
            max_tokens_column=train_task.BUDGET_COLUMN,
            run_id=f"demo-{mode}",
            seed=cfg.seed,
        )
        _warm_up(client)
        # The demo's own instrumentation (the /stats read below) is not training: its seconds
        # are taken off the clock. It is not the same in every mode: the server answers it
        # from its one core, which in april-async is busy generating while the trainer trains.
        clock: dict[str, float] = {"uncounted": 0.0}

        def now_s() -> float:
            return time.perf_counter() - clock["uncounted"]

        class Record(TrainerCallback):
            def on_train_begin(self, *args: Any, **kw: Any) -> None:
                clock["t0"] = now_s()

            def on_log(
                self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any
            ) -> Any:
                if not logs or "reward" not in logs:
                    return control
                rec = adapter.records[-1]
                now = now_s()
                step_s = now - clock.get("last", clock["t0"])
                clock["last"] = now
                row = {
                    "mode": mode,
                    "seed": cfg.seed,
                    "step": int(state.global_step),
                    "wall_s": round(now - clock["t0"], 3),
                    "reward_mean": float(logs["reward"]),
                    "rollout_s": round(rec.wall_s, 3),
                    "train_s": round(max(0.0, step_s - rec.wall_s), 3),
                    "push_s": round(rec.push_s, 3),  # part of train_s: save + weight push
                    "prefetched": len(rec.prefetched),
                    "output_tokens": rec.output_tokens,
                    "returned_tokens": rec.returned_tokens,
                    "stale_tokens": rec.stale_tokens,
                    # Share of loss tokens whose ratio TRL clipped (dapo; with --stale-tokens
                    # correct, the ratio is against the sampling policy: stale ones clip).
                    "clip_region": round(float(logs.get("clip_ratio/region_mean", 0.0)), 4),
                    # With cispo: share of loss tokens whose weight was capped (still trained).
                    "weight_capped": round(float(logs.get("cispo_clip_ratio", 0.0)), 4),
                    "weight_version": rec.weight_version,
                }
                # The server's running totals (each mode has its own server): samples restarted
                # from their prompt for max_staleness, and what calls waited for the
                # background to give way. Off the clock (above).
                asked = time.perf_counter()
                stats = client.stats()
                clock["uncounted"] += time.perf_counter() - asked
                row["staleness_restarts"] = int(stats.get("staleness_restarts", 0))
                row["background_pause_s"] = float(stats.get("background_pause_s", 0.0))
                rows.append(row)
                print(json.dumps(row), flush=True)
                if cfg.wall_budget_s is not None and now - clock["t0"] >= cfg.wall_budget_s:
                    control.should_training_stop = True  # after this step, as sync's ended
                return control

        with tempfile.TemporaryDirectory(prefix="april-train-") as tmp:
            args = GRPOConfig(
                output_dir=tmp,
                per_device_train_batch_size=cfg.prompts_per_step * cfg.num_generations,
                num_generations=cfg.num_generations,
                max_completion_length=cfg.max_completion_length,
                learning_rate=cfg.learning_rate,
                loss_type=cfg.loss_type,
                epsilon_high=LOSS_TYPES[cfg.loss_type],
                lr_scheduler_type="constant",
                max_steps=cfg.steps if cfg.wall_budget_s is None else WALL_STEPS_CAP * cfg.steps,
                temperature=1.0,
                top_p=1.0,
                beta=0.0,
                use_cpu=True,
                bf16=False,
                report_to="none",
                logging_steps=1,
                save_strategy="no",
                disable_tqdm=True,
                seed=cfg.seed,
            )
            trainer = GRPOTrainer(
                model=AutoModelForCausalLM.from_pretrained(model_path),
                reward_funcs=list(train_task.REWARDS),
                args=args,
                train_dataset=Dataset.from_list(
                    train_task.dataset(seed=cfg.seed, max_budget=cfg.max_completion_length)
                ),
                processing_class=AutoTokenizer.from_pretrained(model_path),
                rollout_func=adapter,
                callbacks=[Record(), adapter.callback()],
            )
            trainer.remove_callback(PrinterCallback)  # our rows are the progress lines
            trainer.train()
        if adapter.ledger.outstanding():
            raise RuntimeError(f"groups left on the server: {adapter.ledger.outstanding()}")
    finally:
        server.stop()
        if pin:
            os.sched_setaffinity(0, own_cpus)
            torch.set_num_threads(threads)
    return rows


def _warm_up(client: Any) -> None:
    """One short rollout so neither mode pays the server's first-call costs on its clock."""
    spec = {
        "group_id": "warm-up",
        "input_ids": [5, 6, 7],
        "n": 4,
        "sampling_params": {"max_new_tokens": 16},
    }
    client.rollout([spec], 1, resume_first=False)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="train-demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=DemoConfig.steps)
    p.add_argument("--over-provision", type=float, default=DemoConfig.over_provision)
    p.add_argument(
        "--prompts-per-step",
        type=int,
        default=DemoConfig.prompts_per_step,
        help=f"groups trained on per step ({DemoConfig.num_generations} answers each)",
    )
    p.add_argument(
        "--learning-rate",
        type=float,
        default=DemoConfig.learning_rate,
        help="the trainer's (constant) learning rate, every mode alike",
    )
    p.add_argument("--max-completion-length", type=int, default=DemoConfig.max_completion_length)
    p.add_argument("--stale-tokens", choices=get_args(StaleTokens), default=DemoConfig.stale_tokens)
    p.add_argument(
        "--loss-type",
        choices=sorted(LOSS_TYPES),
        default=DemoConfig.loss_type,
        help="TRL's GRPO loss, every mode alike (cispo: importance weight capped at 5)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=DemoConfig.max_staleness,
        help="versions a kept token may lag (APRIL modes; sent with every call and prefetch)",
    )
    p.add_argument("--seed", type=int, default=DemoConfig.seed)
    p.add_argument("--seeds", default="", help="comma list: every mode once per seed (e.g. 0,1,2)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {','.join(MODES)}")
    p.add_argument("--no-pin", action="store_true", help="do not pin server and trainer cores")
    equal = p.add_mutually_exclusive_group()
    equal.add_argument(
        "--same-wall",
        dest="equal",
        action="store_const",
        const="wall",
        default="wall",
        help="the default: sync trains --steps steps; the other modes train as long as sync did "
        f"(whole steps, at most {WALL_STEPS_CAP}x --steps): equal wall time, not equal steps",
    )
    equal.add_argument(
        "--same-steps",
        dest="equal",
        action="store_const",
        const="steps",
        help="every mode trains --steps steps (a faster mode stops sooner)",
    )
    p.add_argument("--out", type=Path, default=Path("out/train.jsonl"))
    p.add_argument("--plot", type=Path, default=Path("out/train.png"))
    a = p.parse_args(argv)
    seeds = [int(x) for x in a.seeds.split(",") if x] or [a.seed]
    modes = [m for m in a.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes takes a comma list of {MODES}")
    if a.equal == "wall" and modes[0] != "sync":
        p.error(
            "equal wall time (the default) needs sync first in --modes: the others get its wall "
            "time; --same-steps runs every mode --steps steps"
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with open(a.out, "w") as f:
        for seed in seeds:
            cfg = DemoConfig(
                steps=a.steps,
                over_provision=a.over_provision,
                max_completion_length=a.max_completion_length,
                seed=seed,
                stale_tokens=a.stale_tokens,
                pin=not a.no_pin,
                max_staleness=a.max_staleness,
                learning_rate=a.learning_rate,
                loss_type=a.loss_type,
                prompts_per_step=a.prompts_per_step,
            )
            for mode in modes:
                what = f"{cfg.steps} GRPO steps"
                if a.equal == "wall" and mode != "sync":
                    ran = [r["wall_s"] for r in rows if r["seed"] == seed and r["mode"] == "sync"]
                    sync_s = max(ran)
                    cfg = replace(cfg, wall_budget_s=sync_s)
                    what = f"GRPO steps for {sync_s:.1f} s (sync's time)"
                print(
                    f"== {mode}, seed {seed}: {what} on april-server", file=sys.stderr, flush=True
                )
                for row in run_mode(mode, cfg):
                    f.write(json.dumps(row) + "\n")
                    rows.append(row)
                f.flush()
    for seed, rs in by_seed(rows).items():
        print(f"\n== seed {seed}")
        print(table(summarize(rs)))
        print(split_table(rs))
    print()
    print(seeds_table(rows))
    plot(rows, a.plot)
    print(f"rows: {a.out}  plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

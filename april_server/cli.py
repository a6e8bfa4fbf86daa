"""`april-server`: SGLang's server plus the /april/v1 routes.

Every SGLang flag passes through unchanged; ours are `--april-*`. With no `--model-path` the
embedded tiny model is built (offline, cached) and served. Without a CUDA device the
CPU-appropriate defaults below are added unless the same flag was given.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from april_server.settings import env
from april_server.settings.config import LENGTH_ORDERS, PLACEMENTS, AprilConfig

if TYPE_CHECKING:
    from april_server.engine.base import BaseEngine
    from april_server.engine.weight_session import WeightSession
    from april_server.wire.auth import AuthPolicy

CPU_DEFAULTS: list[tuple[str, str | None]] = [
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--cuda-graph-backend-decode", "disabled"),
    ("--cuda-graph-backend-prefill", "disabled"),
    ("--sleep-on-idle", None),  # an idle scheduler otherwise spins a core
    ("--max-total-tokens", "65536"),  # otherwise the KV pool is sized from all of RAM
    ("--dtype", "float32"),  # ~3x faster than bf16 on CPU, and far fewer near-ties
    ("--host", "127.0.0.1"),
]
SHIM_DIR = Path(__file__).parent / "cpu_shim"


def april_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="april-server", add_help=False, allow_abbrev=False)
    p.add_argument("--april-state-dir", type=Path, default=None, help="durable buffer dir")
    p.add_argument("--april-kv-host-bytes", type=int, default=env.DEFAULT_KV_HOST_BYTES)
    p.add_argument("--april-allow-stale-kv", action="store_true")
    p.add_argument(
        "--april-snapshot-sweep-s",
        type=float,
        default=None,
        help="seconds between sweeps freeing KV snapshots nobody refers to (0: never; "
        "default: 10 on an owner, never on one server)",
    )
    p.add_argument(
        "--april-length-order",
        choices=LENGTH_ORDERS,
        default="arrival",
        help="the order a call starts its new groups in when it names no length_order "
        "(predicted lengths; docs/api.md, Length prediction)",
    )
    p.add_argument(
        "--april-placement",
        choices=PLACEMENTS,
        default="least_loaded",
        help="where a segment runs (an owner over several engines): least_loaded, or tail: "
        "samples predicted to run long on one engine, the others on the rest "
        "(docs/api.md, Length prediction)",
    )
    p.add_argument(
        "--april-model",
        choices=["tiny", "tiny-moe", "smollm2"],
        default="tiny",
        help="model to prepare and serve when --model-path is absent (tiny-moe: a mixture of "
        "experts, served with --enable-return-routed-experts)",
    )
    p.add_argument(
        "--april-engines",
        default=None,
        help="owner mode: comma-separated URLs of april engine servers to drive (no local model)",
    )
    p.add_argument(
        "--april-smg",
        default=None,
        help="owner mode: an sgl-model-gateway URL whose worker registry lists the engine servers",
    )
    p.add_argument(
        "--april-tokenizer",
        default=None,
        help="owner mode: tokenizer path for text prompts (default: the engines' model path, "
        "when it exists on this machine)",
    )
    p.add_argument(
        "--april-engine-api-key",
        default=None,
        help="owner mode: the engine servers' admin (or API) key",
    )
    p.add_argument("--april-help", action="store_true", help="show april-server's flags")
    return p


OWNER_FLAGS = ("--host", "--port", "--api-key", "--admin-api-key", "--log-level")


def owner_main(april: argparse.Namespace, rest: list[str], config: AprilConfig) -> None:
    """Run the owner: quota, buffer and policy here; generation on the engine servers."""
    from april_server.fleet.fleet import FleetEngine
    from april_server.fleet.gateway import serve
    from april_server.wire.auth import AuthPolicy

    opts = argparse.ArgumentParser(prog="april-server (owner mode)", allow_abbrev=False)
    opts.add_argument("--host", default="127.0.0.1")
    opts.add_argument("--port", type=int, default=30000)
    opts.add_argument("--api-key", default=None)
    opts.add_argument("--admin-api-key", default=None)
    opts.add_argument("--log-level", default="info")
    args, unknown = opts.parse_known_args(rest)
    if unknown:
        raise SystemExit(
            f"april-server: the owner runs no model and takes only {OWNER_FLAGS} besides "
            f"--april-*; give {unknown} to the engine servers"
        )
    urls = [u.strip() for u in (april.april_engines or "").split(",") if u.strip()]
    discover = None
    if april.april_smg:
        from april_server.fleet.discovery import smg_discovery

        discover = smg_discovery(april.april_smg)
    if not urls and discover is None:
        raise SystemExit("april-server: --april-engines lists no URL")
    fleet = FleetEngine(urls, discover, april.april_engine_api_key, april.april_tokenizer)
    auth = AuthPolicy(args.api_key, args.admin_api_key)
    serve(fleet, config, auth, args.host, args.port, args.log_level)


def has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def int_flag(argv: list[str], names: tuple[str, ...], default: int = 1) -> int:
    """The value of an integer flag given as `--name N` or `--name=N` (the last one wins)."""
    value = default
    for i, a in enumerate(argv):
        for name in names:
            if a == name and i + 1 < len(argv):
                value = int(argv[i + 1])
            elif a.startswith(name + "="):
                value = int(a.split("=", 1)[1])
    return value


def world_size(argv: list[str]) -> int:
    """Scheduler processes SGLang will start: data x tensor x pipeline parallel ranks."""
    dp = int_flag(argv, ("--dp-size", "--data-parallel-size", "--dp"))
    tp = int_flag(argv, ("--tp-size", "--tensor-parallel-size", "--tp"))
    pp = int_flag(argv, ("--pp-size", "--pipeline-parallel-size"))
    return dp * tp * pp


def cpu_bind(cpus: list[int], ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` CPU ranks: the cores split into that many
    contiguous groups ("0|1" for 2 ranks on 2 cores, "0-3|4-7" on 8); with fewer cores than
    ranks, ranks share cores round-robin."""
    cpus = sorted(cpus)
    if len(cpus) < ranks:
        return "|".join(str(cpus[i % len(cpus)]) for i in range(ranks))
    groups = []
    for r in range(ranks):
        part = cpus[r * len(cpus) // ranks : (r + 1) * len(cpus) // ranks]
        contiguous = part == list(range(part[0], part[-1] + 1))
        groups.append(
            f"{part[0]}-{part[-1]}" if contiguous and len(part) > 1 else ",".join(map(str, part))
        )
    return "|".join(groups)


def numa_nodes() -> int:
    return len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1


def set_cpu_parallel_env(argv: list[str]) -> None:
    """SGLang's CPU engine binds each scheduler rank to one NUMA node unless told otherwise,
    and refuses more ranks than nodes: with `--dp-size 2` on one node it needs
    SGLANG_CPU_OMP_THREADS_BIND. Split this process's cores between the ranks, unless the
    variable is set or there are enough nodes."""
    ranks = world_size(argv)
    if ranks <= 1 or ranks <= numa_nodes() or os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_bind(cores, ranks)
    for key, value in cpu_share_env(max(1, len(cores) // ranks)).items():
        os.environ.setdefault(key, value)


def cpu_share_env(threads: int) -> dict[str, str]:
    """Environment for CPU schedulers that share this machine, `threads` cores each. SGLang
    applies SGLANG_CPU_OMP_THREADS_BIND only on AMX or arm64 CPUs; elsewhere each scheduler
    would run one OpenMP thread per core, and schedulers sharing cores then spin against each
    other (measured here: two engines on 2 cores ran ~6x slower than one)."""
    return {"OMP_NUM_THREADS": str(threads)}


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def install_cpu_shim() -> None:
    """Expose the CPU `sgl_kernel` to this process and SGLang's spawned children, unless a
    real one is importable."""
    try:
        import sgl_kernel  # noqa: F401

        return
    except Exception:
        pass
    sys.path.insert(0, str(SHIM_DIR))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(SHIM_DIR) + (os.pathsep + old if old else "")


# What the embedded models are called on the OpenAI routes (`/v1/models`, `model` fields).
EMBEDDED_NAMES = {
    "tiny": "april-tiny",
    "tiny-moe": "april-tiny-moe",
    "smollm2": "SmolLM2-135M-Instruct",
}


def embedded_model_path(name: str) -> str:
    from april_server.models import ensure_smollm2, ensure_tiny_model, ensure_tiny_moe

    builders = {"tiny": ensure_tiny_model, "tiny-moe": ensure_tiny_moe, "smollm2": ensure_smollm2}
    return str(builders[name]())


def build_argv(argv: list[str], april: argparse.Namespace, cpu: bool) -> list[str]:
    out = list(argv)
    if not has_flag(out, "--model-path") and not has_flag(out, "--model"):
        out += ["--model-path", embedded_model_path(april.april_model)]
        if not has_flag(out, "--served-model-name"):  # not the cache path, in /v1/models
            out += ["--served-model-name", EMBEDDED_NAMES[april.april_model]]
        if april.april_model == "tiny-moe" and not has_flag(out, "--enable-return-routed-experts"):
            out += ["--enable-return-routed-experts"]  # the model is there for its routing
    if cpu:
        for flag, value in CPU_DEFAULTS:
            if not has_flag(out, flag):
                out += [flag] if value is None else [flag, value]
    return out


def prepare_sglang_env(cpu: bool) -> None:
    """What SGLang must see before it is imported (the test suite's zygote does the same)."""
    if cpu:
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        install_cpu_shim()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a hub
    os.environ.setdefault("SGLANG_PLUGINS", "april")  # our scheduler hooks, no stray plugins
    # `/health` answers from the event loop (liveness: the loop, and so every route, is
    # responsive); SGLang's default makes it generate a token and sleep >= 1 s first. The deep
    # check stays at `/health_generate`. Set the variable to 1 for SGLang's behaviour.
    os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    april, rest = april_parser().parse_known_args(argv)
    if april.april_help:
        april_parser().print_help()
        return
    bad = [a for a in rest if a.startswith("--april")]
    if bad:
        raise SystemExit(f"april-server: unknown flag(s) {bad}; see --april-help")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = AprilConfig(
        state_dir=april.april_state_dir,
        kv_host_bytes=april.april_kv_host_bytes,
        allow_stale_kv=april.april_allow_stale_kv,
        snapshot_sweep_s=april.april_snapshot_sweep_s,
        length_order=april.april_length_order,
        placement=april.april_placement,
    )
    if april.april_engines or april.april_smg:
        owner_main(april, rest, config)
        return
    cpu = not cuda_available()
    prepare_sglang_env(cpu)
    if cpu:
        set_cpu_parallel_env(rest)
    env.set_kv_host_bytes(april.april_kv_host_bytes)
    if cpu:  # SGLang's children import SGLang beside this process's own import (preload.py)
        from april_server.door.preload import start_fork_server

        start_fork_server()
    from april_server.door.engine import launch
    from april_server.engine.weight_session import WeightSession

    # SGLang's weight routes (the door's hooks) and the root share one weight session: a push
    # cuts the segments the root runs. The door runs SGLang; the routes come from the layers
    # above it, handed down.
    weights = WeightSession()
    mount = functools.partial(mount_routes, config, weights)
    launch(build_argv(rest, april, cpu), config, weights, mount)


def mount_routes(
    config: AprilConfig,
    weights: WeightSession,
    app: Any,
    make_engine: Callable[[], BaseEngine],
    auth: AuthPolicy,
) -> None:
    """The routes april-server adds to SGLang's app (`door.engine.launch` calls this with the
    config and the weight session bound): the /april/v1 API over one root, and the engine
    routes, so that any april-server can be one engine of a fleet driven by an owner
    elsewhere. The durable buffer is opened now, at start-up; the root is built on first use."""
    from april_server.fleet.engine_routes import create_engine_router
    from april_server.http.app import create_router, extend_app
    from april_server.root.holder import RootHolder

    root = RootHolder(config, make_engine, weights)
    app.include_router(create_router(root.get, config, auth))
    app.include_router(create_engine_router(lambda: root.get().engine, auth))
    extend_app(app)


if __name__ == "__main__":
    main()

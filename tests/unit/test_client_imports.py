"""How the client is imported: the package is `april_client` (sources in clients/), importing it
needs only httpx and msgspec, and the folder name `clients` is not an import name (no alias)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import april_client
from tests.unit.client_fakes import ROOT


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


def test_a_vendored_copy_works_under_its_own_name(tmp_path: Path) -> None:
    """The README's vendoring recipe: clients/ (without bench/) under any package name, next to
    a top-level april_server/ holding only its __init__.py and wire/ (__init__.py, protocol.py)."""
    shutil.copytree(
        ROOT / "clients",
        tmp_path / "mytrainer" / "vendored",
        ignore=shutil.ignore_patterns("bench", "__pycache__"),
    )
    (tmp_path / "mytrainer" / "__init__.py").write_text("")
    (tmp_path / "april_server" / "wire").mkdir(parents=True)
    for name in ("__init__.py", "wire/__init__.py", "wire/protocol.py"):
        shutil.copy(ROOT / "april_server" / name, tmp_path / "april_server" / name)
    code = (
        "import sys, warnings\n"
        "warnings.simplefilter('error')\n"
        "sys.meta_path[:] = [f for f in sys.meta_path"
        " if 'editable' not in getattr(f, '__module__', '')]\n"
        "from mytrainer.vendored import AprilClient, NotFound\n"
        "import april_server\n"
        "assert 'clients' not in sys.modules and 'april_client' not in sys.modules\n"
        "print(AprilClient.__module__, april_server.__file__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    module, server = out.stdout.split()
    assert module == "mytrainer.vendored._sync"
    assert server == str(tmp_path / "april_server" / "__init__.py")


def test_the_distribution_ships_april_client_and_not_clients() -> None:
    """setuptools cannot rename a package it finds, so pyproject lists them: the list must be
    every package of the tree, with clients/ shipped as `april_client`."""
    setuptools = pytest.importorskip("setuptools")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tool = conf["tool"]["setuptools"]
    found = setuptools.find_namespace_packages(str(ROOT), include=["april_server*", "kernels*"])
    found += [
        "april_client" + p.removeprefix("clients")
        for p in setuptools.find_namespace_packages(str(ROOT), include=["clients*"])
    ]
    assert sorted(tool["packages"]) == sorted(found)
    assert tool["package-dir"] == {"april_client": "clients"}
    assert not any(p.split(".")[0] == "clients" for p in tool["packages"])
    assert conf["project"]["scripts"]["april-bench"] == "april_client.bench.cli:main"

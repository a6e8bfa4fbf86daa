"""Architecture rules that a reviewer would otherwise have to check by hand."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOOR = ROOT / "april_server" / "door"


def imported_modules(path: Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
    return mods


def test_the_door_package_is_the_only_importer_of_sglang() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "april_server").rglob("*.py"))
        if DOOR not in p.parents and any(m.split(".")[0] == "sglang" for m in imported_modules(p))
    ]
    assert offenders == []
    assert any(m.startswith("sglang") for m in imported_modules(DOOR / "engine.py"))


def test_bookkeeping_is_plain_python() -> None:
    """Everything but the door (SGLang's side), the HTTP surface and the entry points."""
    plain = [
        "settings",
        "wire",
        "rules",
        "buffer",
        "engine",
        "runtime",
        "calls",
        "operations",
        "root",
    ]
    paths = [p for pkg in plain for p in sorted((ROOT / "april_server" / pkg).glob("*.py"))]
    assert len(paths) > 40
    for p in paths:
        mods = imported_modules(p)
        assert not {m.split(".")[0] for m in mods} & {"torch", "sglang", "triton"}, p


def test_no_pickle_or_eval_of_request_data() -> None:
    for p in sorted((ROOT / "april_server").rglob("*.py")):
        assert "pickle" not in imported_modules(p), p
        calls = {
            n.func.id
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        assert not calls & {"eval", "exec", "compile", "__import__"}, p


MAX_LINES = 450  # a file past this has a part with a name of its own: split it out


def test_no_source_file_is_over_450_lines() -> None:
    """Every .py file of the server, the client (and its benchmarks) and the kernels."""
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for top in ("april_server", "clients", "kernels")
        for p in sorted((ROOT / top).rglob("*.py"))
    }
    assert len(sizes) > 100
    offenders = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert offenders == {}, f"over {MAX_LINES} lines: {offenders}"

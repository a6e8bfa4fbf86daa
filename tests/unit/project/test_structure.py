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


UNIT = ROOT / "tests" / "unit"
# The unit tests mirror the code: tests/unit/<package>/test_<module>.py. A folder is named for
# a subpackage of april_server, or for one of the code's other homes below; `project` tests
# the repository as a whole (its layers, docs, simulator), so it names no package.
OTHER_HOMES = {
    "client": ROOT / "clients",
    "bench": ROOT / "clients" / "bench" / "april_bench",
    "examples": ROOT / "examples",
}
WHOLE_PROJECT = "project"


def home_of(folder: str) -> Path:
    return OTHER_HOMES.get(folder, ROOT / "april_server" / folder)


def modules_of(package: Path) -> set[str]:
    """The names a test module may be named for: the package's modules and subpackages."""
    files = {p.stem for p in package.glob("*.py")}
    return files | {p.name for p in package.iterdir() if (p / "__init__.py").exists()}


def names_a_module(test: Path, modules: set[str]) -> bool:
    """`test_<module>.py`, `test_<module>_<aspect>.py`, or, for a module named for the behaviour
    it guards, a docstring that names the module (`<module>.py`)."""
    name = test.stem.removeprefix("test_")
    if name in modules or any(name.startswith(m + "_") for m in modules):
        return True
    doc = ast.get_docstring(ast.parse(test.read_text())) or ""
    return any(f"{m}.py" in doc for m in modules)


def test_every_unit_test_folder_is_named_for_a_package() -> None:
    folders = sorted(p for p in UNIT.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert len(folders) > 10
    strays = [
        f.name
        for f in folders
        if f.name != WHOLE_PROJECT and not (home_of(f.name) / "__init__.py").exists()
    ]
    assert strays == [], f"tests/unit folders that mirror no package: {strays}"
    assert all((f / "__init__.py").exists() for f in folders)


def test_every_unit_test_module_names_the_module_it_guards() -> None:
    tests = {test: ROOT / "april_server" for test in UNIT.glob("test_*.py")}  # top-level modules
    for folder in UNIT.iterdir():
        if folder.is_dir() and folder.name not in (WHOLE_PROJECT, "__pycache__"):
            tests.update({test: home_of(folder.name) for test in folder.glob("test_*.py")})
    assert len(tests) > 60
    unnamed = sorted(
        str(test.relative_to(UNIT))
        for test, package in tests.items()
        if not names_a_module(test, modules_of(package))
    )
    assert unnamed == [], f"test modules that name no module of their package: {unnamed}"

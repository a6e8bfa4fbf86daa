"""Architecture rules that a reviewer would otherwise have to check by hand."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import Counter
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


# Outside the server, SGLang is imported only as a yardstick, never to serve (both are named in
# docs/architecture.md, "One door to SGLang").
SGLANG_YARDSTICKS = {
    "kernels/bench_kv_copy.py",  # SGLang's own KV copy, a column of the copy benchmark
    "clients/april_bench/gpu_check/server_parts.py",  # the GPU run loads SGLang's model config
}


def test_the_door_package_is_the_only_importer_of_sglang() -> None:
    importers = {
        str(p.relative_to(ROOT))
        for top in ("april_server", "clients", "kernels", "examples")
        for p in sorted((ROOT / top).rglob("*.py"))
        if any(m.split(".")[0] == "sglang" for m in imported_modules(p))
    }
    outside = {p for p in importers if not p.startswith("april_server/door/")}
    assert outside == SGLANG_YARDSTICKS
    assert any(m.startswith("sglang") for m in imported_modules(DOOR / "engine.py"))
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    assert all(f"`{p}`" in architecture for p in SGLANG_YARDSTICKS)


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


# SGLang calls our plugin hooks as module-level functions, so the once-only registrations and
# what a scheduler process holds once (its KV state, reached from `release_kv_cache`) can only
# be module state; nothing else of the server is.
PLUGIN_STATE = {
    ("april_server/door/deterministic.py", "_registered"),
    ("april_server/door/moe_hooks.py", "_registered"),
    ("april_server/door/preload.py", "_started"),
    ("april_server/door/scheduler_hooks.py", "_active"),
}
MUTATORS = {"append", "extend", "insert", "add", "update", "setdefault", "__setitem__"}


def module_state(path: Path) -> list[str]:
    """What wires parts through module or class state: `global` rebinding, a module-level
    container changed inside a function (a registry), a class used as a global (`Name.x = `)."""
    tree = ast.parse(path.read_text())
    found = [
        f"global {n}" for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names
    ]
    module_names = {
        t.id
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name)
    }
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    functions = [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    for fn in functions:
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id in module_names:
                    if node.func.attr in MUTATORS:
                        found.append(f"registry {owner.id}.{node.func.attr}")
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                    if target.value.id in module_names:
                        found.append(f"registry {target.value.id}[...]")
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    if target.value.id in classes or target.value.id == "cls":
                        found.append(f"class state {target.value.id}.{target.attr}")
    return found


def test_no_module_global_wires_a_part() -> None:
    """Parts are handed what they use (the root builds them; the process hands the door its
    weight session): no module-level registry, no class used as a global."""
    found = {
        (str(p.relative_to(ROOT)), what)
        for p in sorted((ROOT / "april_server").rglob("*.py"))
        for what in module_state(p)
    }
    assert found == {(path, f"global {name}") for path, name in PLUGIN_STATE}


def test_the_module_state_check_sees_registries_and_class_globals(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "_listeners = []\n"
        "class Session:\n    open = False\n"
        "def listen(f):\n    _listeners.append(f)\n"
        "def begin():\n    Session.open = True\n"
    )
    assert module_state(src) == ["registry _listeners.append", "class state Session.open"]


MAX_LINES = 500  # formatted: a file past this has a part with a name of its own: split it out
PYTHON_HOMES = ("april_server", "clients", "kernels", "tests", "examples")


def test_no_source_file_is_over_500_lines() -> None:
    """Every .py file of the server, the client, the bench and the kernels, as the formatter
    lays it out (no `fmt: skip` compresses it: the next test)."""
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for top in ("april_server", "clients", "kernels")
        for p in sorted((ROOT / top).rglob("*.py"))
    }
    assert len(sizes) > 100
    offenders = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert offenders == {}, f"over {MAX_LINES} lines: {offenders}"


def is_literal(node: ast.expr) -> bool:
    """A constant, a name or an attribute (a symbolic constant), or a container of those."""
    if isinstance(node, (ast.Constant, ast.Name, ast.Attribute)):
        return True
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.operand, ast.Constant)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return all(is_literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and is_literal(k) for k in node.keys) and all(
            is_literal(v) for v in node.values
        )
    return False


def is_data_table(stmt: ast.stmt) -> bool:
    """`NAME = [...]` (or a dict, tuple, set): a named constant of three or more rows of
    literals, which may read better aligned than the formatter lays it out."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target, value = stmt.targets[0], stmt.value
    elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
        target, value = stmt.target, stmt.value
    else:
        return False
    if not (isinstance(target, ast.Name) and target.id.isupper()):
        return False
    rows = value.keys if isinstance(value, ast.Dict) else getattr(value, "elts", [])
    return len(rows) >= 3 and is_literal(value)


def statement_ending_at(tree: ast.Module, line: int) -> ast.stmt | None:
    """The innermost statement whose last line (a compound one's header) is `line`."""
    found = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            last = body[0].lineno - 1 if isinstance(body, list) and body else node.end_lineno
            if node.lineno <= line <= (last or node.lineno):
                if found is None or node.lineno >= found.lineno:
                    found = node
    return found


def formatter_comments(text: str) -> list[tuple[int, str]]:
    """(line, comment) of every `# fmt: ...` comment (comments only, not strings)."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [
        (tok.start[0], tok.string)
        for tok in tokens
        if tok.type == tokenize.COMMENT and tok.string.replace(" ", "").startswith("#fmt:")
    ]


def test_the_formatter_decides_except_on_data_tables() -> None:
    """`# fmt: skip` only on a named table of literals; everywhere else the formatter lays
    the code out (a module too long when formatted is split by concept, never compressed)."""
    skipped, misplaced = 0, []
    for top in PYTHON_HOMES:
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text()
            comments = formatter_comments(text) if "fmt:" in text else []
            tree = ast.parse(text) if comments else None
            for line, comment in comments:
                stmt = statement_ending_at(tree, line) if tree is not None else None
                if comment.replace(" ", "") == "#fmt:skip" and stmt and is_data_table(stmt):
                    skipped += 1
                else:
                    misplaced.append(f"{path.relative_to(ROOT)}:{line} {comment}")
    assert misplaced == [], f"formatter switched off on code that is not a data table: {misplaced}"
    assert skipped > 0  # the check saw the tables it allows


def test_the_data_table_rule_tells_tables_from_code() -> None:
    def first(src: str) -> ast.stmt:
        return ast.parse(src).body[0]

    assert is_data_table(first("OPS = {'a': 1, 'b': 2, 'c': 3}"))
    assert is_data_table(first("CASES = [(400, Bad), (404, NotFound), (409, x.Conflict)]"))
    assert not is_data_table(first("body = {'a': 1, 'b': 2, 'c': 3}"))  # a local value
    assert not is_data_table(first("OPS = {'a': f(1), 'b': 2, 'c': 3}"))  # a call
    assert not is_data_table(first("PAIR = (1, 2)"))  # too short to be a table
    assert not is_data_table(first("x = g(a,\n      b)"))


def test_no_server_function_is_called_only_by_tests() -> None:
    """A function or method of the server whose name no code but its own definition and the
    tests mentions is test scaffolding living in production: it belongs in the tests."""
    code = {
        p: p.read_text()
        for top in PYTHON_HOMES
        if top != "tests"
        for p in (ROOT / top).rglob("*.py")
    }
    words = Counter(w for text in code.values() for w in re.findall(r"\w+", text))
    tested = set(
        re.findall(r"\w+", "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py")))
    )
    only_tests = sorted(
        f"{p.relative_to(ROOT)}:{node.name}"
        for p, text in code.items()
        if p.is_relative_to(ROOT / "april_server")
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and not node.name.startswith("__")
        and words[node.name] == 1
        and node.name in tested
    )
    assert only_tests == []


UNIT = ROOT / "tests" / "unit"
# The unit tests mirror the code: tests/unit/<package>/test_<module>.py. A folder is named for
# a subpackage of april_server, or for one of the code's other homes below; `project` tests
# the repository as a whole (its layers, docs, simulator), so it names no package.
OTHER_HOMES = {
    "client": ROOT / "clients" / "april_client",
    "bench": ROOT / "clients" / "april_bench",
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

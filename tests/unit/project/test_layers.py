"""The layer order of the code, lowest first. A module may import from its own layer and the
layers below it, never from one above: the arrows run one way, so a lower layer can be read,
tested and reused without the ones above it. (Which package may import SGLang is checked in
test_structure.py.)"""

from __future__ import annotations

from pathlib import Path

from tests.unit.project.test_structure import ROOT

# Lowest first, one subpackage of april_server each (docs/architecture.md, "Layers"). `kernels`
# imports nothing of ours (its GPU-check parts included). Then the bookkeeping, plain Python:
# settings; the wire contract; pure rules; the buffer and its store; the engine side (what an engine
# offers, the segment runner); the runtime (background, live calls, persister, sweep); the call
# state machine; the other operations; the composition root that builds and wires all of them
# (`root`). The door runs SGLang (and only it imports SGLang). `http` is the /april/v1 router over
# one root and the holder that builds it. The fleet builds on those to drive engines on other
# machines. `entry` (the command line, the model builder, the launcher that starts a server as a
# child process) wires a process from all of them. The client sits on top; its wire types
# (`april_client.protocol`) are the server's wire layer, shared. The bench (clients/april_bench/),
# which launches servers and speaks through the client, is above it. The GPU-check harness
# (april_bench.gpu_check) starts servers and benchmarks, so it is above everything.
LAYERS = [
    "kernels", "settings", "wire", "rules", "buffer", "engine", "runtime", "calls", "operations",
    "root", "door", "http", "fleet", "entry", "april_client", "april_bench", "harness",
]  # fmt: skip
NAMED = {
    **{f"april_server.{pkg}": pkg for pkg in LAYERS[1:13]},
    "april_client.protocol": "wire",  # msgspec only: the contract both sides speak
    "april_bench.gpu_check": "harness",
    "april_server.cpu_shim": "kernels",  # SGLang's CPU stand-ins: nothing of ours
    "april_server.cli": "entry",
    "april_server.launcher": "entry",
    "april_server.models": "entry",
    "april_server.__main__": "entry",
}


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name of ours; None for anything else (stdlib, third party)."""
    if module == "april_server":  # the package itself: its version only
        return LAYERS.index("settings")
    for prefix, layer in NAMED.items():
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS.index(layer)
    root = module.split(".")[0]
    assert root != "april_server", f"{module}: in no layer (add its subpackage to LAYERS)"
    return LAYERS.index(root) if root in LAYERS else None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "clients":  # clients/april_client/, clients/april_bench/: named as imported
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(module: str, level: int, importer: str, is_package: bool) -> str:
    """An import's absolute name (relative imports resolved against the importer)."""
    if level == 0:
        return module
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def upward_imports() -> list[str]:
    import ast

    bad = []
    for top in ("kernels", "april_server", "clients"):
        for path in sorted((ROOT / top).rglob("*.py")):
            me = module_name(path)
            mine = layer_of(me)
            assert mine is not None, me
            for node in ast.walk(ast.parse(path.read_text())):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = resolve(node.module or "", node.level, me, path.name == "__init__.py")
                    names = [base] + [f"{base}.{a.name}" for a in node.names]
                for name in names:
                    theirs = layer_of(name)
                    if theirs is not None and theirs > mine:
                        bad.append(f"{me} -> {name}")
    return sorted(set(bad))


def test_no_import_runs_up_the_layers() -> None:
    assert upward_imports() == []


def test_the_layer_rule_sees_an_upward_import() -> None:
    """The rule itself: a door module reaching into the fleet, or kernels into the server, is
    counted as upward (so the test above cannot pass by classifying nothing)."""

    def at(module: str) -> int:
        layer = layer_of(module)
        assert layer is not None, module
        return layer

    assert at("april_server.fleet.engine_routes") > at("april_server.door.engine")
    assert at("april_client.protocol") > at("kernels.kv_copy")
    assert at("april_server.http.app") > at("april_server.door.engine")
    assert at("april_server.cli") > at("april_server.fleet.gateway")
    assert at("april_bench.gpu_check.server_parts") > at("april_server.cli")
    assert at("april_bench.gpu_check") > at("april_bench.cli")
    assert at("april_server.launcher") > at("kernels.gpu_check.parts")
    assert at("april_client") > at("april_server.cli")
    assert at("april_bench.cli") > at("april_client")
    assert at("april_server.root.manager") > at("april_server.engine.segment_runner")
    assert at("april_server.root.manager") > at("april_server.calls.rollout")
    assert at("april_client.protocol") > at("april_server.settings.config")
    assert at("april_server.buffer.store") > at("april_client.protocol")
    assert layer_of("torch") is None
    assert module_name(ROOT / "clients" / "april_bench" / "cli.py") == "april_bench.cli"
    assert module_name(ROOT / "clients" / "april_client" / "_sync.py") == "april_client._sync"
    assert resolve("wire", 1, "april_server.fleet.remote", False) == "april_server.fleet.wire"


def test_kernels_import_nothing_of_ours() -> None:
    """kernels/ is the leaf: no module of it (the GPU check's kernel parts included) imports
    the server, the client or the bench, directly or inside a function."""
    import ast

    ours = {"april_server", "april_client", "april_bench", "clients", "tests", "examples"}
    found = []
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{module_name(path)} -> {n}" for n in names if n.split(".")[0] in ours]
    assert len(list((ROOT / "kernels" / "gpu_check").glob("*.py"))) >= 5
    assert found == []


def import_cycles() -> list[list[str]]:
    """Groups of april_server modules that import each other, directly or around a loop. Every
    import counts: one made only for type checking, or inside a function, is the same
    dependency."""
    import ast

    graph: dict[str, set[str]] = {}
    paths = {module_name(p): p for p in sorted((ROOT / "april_server").rglob("*.py"))}
    for me, path in paths.items():
        deps = graph.setdefault(me, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(node.module or "", node.level, me, path.name == "__init__.py")
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps.update(n for n in names if n in paths and n != me)
    return strongly_connected(graph)


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm; only the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_in_the_server() -> None:
    assert import_cycles() == []


def test_the_cycle_check_finds_a_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]

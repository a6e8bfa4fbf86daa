"""The deprecated import name `clients`, kept for existing code run from a checkout.

The package is `april_client` (its sources stay in the `clients/` folder). With the repo root on
`sys.path`, `import clients` still finds this folder under its folder name; the package's
`__init__` then calls `alias()`, which loads the package once as `april_client` and makes
`clients` and every `clients.X` other names for the same modules, so each class exists once
(`clients.AprilError is april_client.AprilError`). An installed april-server provides only
`april_client`. `python -m clients.bench.X` keeps working too (runpy reads the code through the
alias).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import CodeType, ModuleType

NEW = "april_client"
HERE = Path(__file__).resolve().parent


def alias(old: str) -> None:
    """Make `old` (and `old.X`) the same module objects as `april_client` (`april_client.X`)."""
    new = _load_new()
    if not any(getattr(f, "april_alias_of", None) == old for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder(old))
    sys.modules[old] = new  # what `import clients` returns (the import system reads it back)
    sys.modules.pop(f"{old}._legacy", None)  # this helper, loaded under the old name
    # alias() <- clients/__init__.py <- the code that imports `clients` (warnings skips the
    # import machinery's frames), so the warning shows for a script by default.
    warnings.warn(
        f"`{old}` is deprecated: import `{NEW}` (e.g. `from {NEW} import AprilClient`)",
        DeprecationWarning,
        stacklevel=3,
    )


def _load_new() -> ModuleType:
    """`april_client`: already imported, or loaded from this folder (what `import clients` found;
    with an editable install that is the same folder)."""
    if NEW in sys.modules:
        return sys.modules[NEW]
    spec = importlib.util.spec_from_file_location(
        NEW, HERE / "__init__.py", submodule_search_locations=[str(HERE)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[NEW] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[NEW]
        raise
    return module


class _AliasFinder(MetaPathFinder):
    """Finds `clients.X` as the module `april_client.X`, while `clients` is the alias."""

    def __init__(self, old: str) -> None:
        self.april_alias_of = old

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        old = self.april_alias_of
        if not fullname.startswith(old + ".") or sys.modules.get(old) is not sys.modules.get(NEW):
            return None
        new_name = NEW + fullname[len(old) :]
        real = importlib.util.find_spec(new_name)
        if real is None:
            return None
        spec = ModuleSpec(
            fullname,
            _AliasLoader(new_name, real.loader),
            origin=real.origin,
            is_package=real.submodule_search_locations is not None,
        )
        spec.has_location = real.has_location
        return spec


class _AliasLoader(Loader):
    def __init__(self, new_name: str, real: Loader | None) -> None:
        self.new_name = new_name
        self.real = real

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return None  # a placeholder: exec_module swaps in the real module

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.new_name)

    def get_code(self, fullname: str) -> CodeType | None:
        """For `python -m clients.bench.X` (runpy runs the code of `april_client.bench.X`)."""
        get_code = getattr(self.real, "get_code", None)
        return None if get_code is None else get_code(self.new_name)

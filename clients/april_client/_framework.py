"""The trainer adapters import their framework only when used, with an error naming the install.

The client installs and imports with httpx and msgspec alone (tests/unit/client/
test_imports.py); `april_client.slime`, `.verl` and `.areal` reach their framework through
`framework` the first time they need it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = {
    "slime": "slime's source on sys.path (it is not on PyPI: github.com/THUDM/slime)",
    "verl": "pip install verl==0.9.1 (tested with 0.9.1)",
    "areal": "pip install areal==1.0.4 (tested with 1.0.4)",
}


class MissingFramework(ImportError):
    """The adapter's framework (or a module it imports) is not importable here."""


def framework(module: str) -> ModuleType:
    """Import `module` of a framework, or raise `MissingFramework` naming what to install."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = INSTALL.get(top, f"install {top}")
        raise MissingFramework(
            f"april_client's {top} adapter needs {module!r}, which did not import ({exc}): {hint}"
        ) from exc

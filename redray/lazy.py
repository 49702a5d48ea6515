"""Package exports imported when first used (PEP 562), so importing a package is cheap."""

from __future__ import annotations

import importlib
import sys


def exports(package: str, names: dict[str, list[str]], extra: list[str] = ()):
    """(``__all__``, ``__getattr__``, ``__dir__``) for ``package``, whose public names are
    ``names`` (module -> the names it defines) plus ``extra`` (defined in the package
    itself). A submodule is imported on first use too (``redray.models`` after a bare
    ``import redray``)."""
    where = {name: module for module, listed in names.items() for name in listed}

    def __getattr__(name: str):
        module = where.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as error:
                if error.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(where))

    return sorted([*where, *extra]), __getattr__, __dir__

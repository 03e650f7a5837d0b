"""A package's public names imported on first use (PEP 562), so importing the package, or a
torch-free module of it, loads none of its heavy modules: the command line builds its parser
and answers ``--help``, ``--version`` and its argument errors without torch.

    __getattr__, __dir__ = lazy_exports(globals(), {"Trainer": "kasoku.train.trainer", ...})
"""
from __future__ import annotations

import importlib


def lazy_exports(namespace: dict, exports: dict[str, str]):
    """``(__getattr__, __dir__)`` for the package whose globals are ``namespace``: each name of
    ``exports`` (name -> the module that defines it) is imported from its module when first
    looked up, then kept in ``namespace`` (later lookups skip ``__getattr__``). A submodule's
    name not among ``exports`` is left to the import system (``from PACKAGE import module``)."""
    package = namespace["__name__"]

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__

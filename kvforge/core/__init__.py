"""kvforge's shared core: the contract, manifest, errors and targets that every layer reads.

Importing it first checks that `kvforge` is the installed package. A clone of the repository named
`kvforge` beside a script shadows an editable install: Python takes the clone's root (which holds no
`__init__.py`) as a namespace package, and later fails with "cannot import name '__version__' from
'kvforge' (unknown location)", which does not say why."""

from __future__ import annotations

import sys


def _check_not_shadowed() -> None:
    root = sys.modules.get("kvforge")
    if root is None or getattr(root, "__file__", None) is not None:
        return
    where = ", ".join(str(path) for path in getattr(root, "__path__", [])) or "a folder"
    raise ImportError(f"'kvforge' was imported from {where}, a folder without kvforge's __init__.py: most likely a "
                      "clone of the kvforge repository named 'kvforge' beside your script or your working folder, "
                      "which Python takes before the installed package. Run from another folder, or rename the "
                      "clone (e.g. kvforge-src)")


_check_not_shadowed()
from kvforge import __version__  # noqa: E402  (after the check, so a shadowed install gets its explanation)

__all__ = ["__version__"]

"""A third-party import that costs every run's start and buys it nothing: scikit-learn, through transformers.

    skip_sklearn_in_transformers()   # once per process, before transformers is imported (cheap: an import hook)

makes transformers see no scikit-learn in this process: it patches transformers' own check
(`transformers.utils.import_utils.is_sklearn_available`) as that module finishes loading, so a process that
never imports transformers pays nothing. Where transformers' generation utilities were imported already, it
changes nothing. Why, and what it saves (2.6 s of a model import): docs/internals.md#commonimport_costpy
"""

from __future__ import annotations

import importlib.abc
import sys

CHECKS = "transformers.utils.import_utils"  # where transformers decides whether scikit-learn is there


def _no_sklearn() -> bool:
    return False


def _patch(module) -> None:
    if hasattr(module, "is_sklearn_available"):
        module.is_sklearn_available = _no_sklearn


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Finds CHECKS with the other finders and patches the module right after its body runs (before the package
    that imports it copies the function's name)."""

    def find_spec(self, name, path, target=None):
        if name != CHECKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run = spec.loader.exec_module

                def exec_module(module, run=run):
                    run(module)
                    _patch(module)

                try:
                    spec.loader.exec_module = exec_module  # this spec's own loader object
                except (AttributeError, TypeError):  # a loader that takes no attributes: transformers as it is
                    return None
                return spec
        return None


def skip_sklearn_in_transformers() -> None:
    """See the module docstring; idempotent."""
    if "transformers.generation.candidate_generator" in sys.modules:
        return  # too late: scikit-learn was imported with it
    if CHECKS in sys.modules:
        _patch(sys.modules[CHECKS])
        utils = sys.modules.get("transformers.utils")
        if utils is not None:
            _patch(utils)
        return
    if not any(isinstance(f, _PatchOnLoad) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnLoad())

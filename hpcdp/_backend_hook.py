"""``import hpcdp`` registers the torch.distributed backend ``"hpcdp"`` without importing torch.

Where torch is already imported, :mod:`hpcdp.dist` is imported (and registers) now;
otherwise a one-shot import hook does it right after ``import torch`` finishes, so
``dist.init_process_group("hpcdp")`` works whichever of the two a script imports first,
and scripts that never import torch never pay for it.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["register_when_torch_loads"]


def register_when_torch_loads() -> None:
    if "torch" in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())


def _register() -> None:
    torch = sys.modules["torch"]
    if getattr(torch, "distributed", None) is not None and torch.distributed.is_available():
        importlib.import_module("hpcdp.dist")


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the import of ``torch`` it removes itself and wraps the real
    loader so that :func:`_register` runs once torch's module has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                _register()
            except Exception as exc:  # never fail torch's own import: say so instead
                warnings.warn(f"hpcdp could not register the torch.distributed backend "
                              f"'hpcdp': {exc!r}", RuntimeWarning, stacklevel=2)
        spec.loader.exec_module = exec_then_register
        return spec

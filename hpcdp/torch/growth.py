"""Parameters added to a model after :class:`~hpcdp.DistributedDataParallel` wrapped it.

The wrapper averages the gradients of the parameters its model had when it was wrapped.
A module attached afterwards (a new head, LoRA adapters, ``weight_norm`` applied late)
would train on local gradients only, and the replicas would drift apart without a word.
:class:`GrowthWatch` turns that into an error before the step that would diverge:

1. The watch enters every module of the model in a process-wide table (module id to the
   watches that hold it).
2. Two global torch hooks, on module and on parameter registration, mark the watches
   of the module being changed. A registration anywhere else costs one dict lookup.
3. Before its next training forward, a marked wrapper asks :meth:`GrowthWatch.added`
   for the model's parameters it does not know (by identity: a module moved within the
   model, or a parametrization that keeps the original tensor, adds nothing). It takes
   the new modules into the table, and the wrapper raises
   :class:`~hpcdp.errors.ModelChangedError` naming them.

Only a mark costs a walk over the model; an unmarked forward reads one attribute.
"""
from __future__ import annotations

import weakref

import torch

__all__ = ["GrowthWatch"]

_WATCHES: dict[int, weakref.WeakSet] = {}  # id(module): the watches whose model holds it
_HOOKS = []


def _mark(module, name, value) -> None:
    watches = _WATCHES.get(id(module))
    if watches:  # an id reused by another module only costs that module's watches a recheck
        for w in watches:
            w.marked = True


def _forget(ids: list[int]) -> None:
    for i in ids:
        watches = _WATCHES.get(i)
        if watches is not None and next(iter(watches), None) is None:  # no live watch holds it
            del _WATCHES[i]


def _install_hooks() -> None:
    if not _HOOKS:
        from torch.nn.modules.module import (register_module_module_registration_hook,
                                             register_module_parameter_registration_hook)
        _HOOKS.append(register_module_module_registration_hook(_mark))
        _HOOKS.append(register_module_parameter_registration_hook(_mark))


class GrowthWatch:
    """Notices parameters registered on ``module``'s modules after ``known`` (the ids of
    the parameters the wrapper averages or watches) was taken."""

    def __init__(self, module: torch.nn.Module, known: set[int]):
        self.module = module
        self.known = known
        self.marked = False
        self._ids: list[int] = []  # the table's entries this watch is in, dropped with it
        _install_hooks()
        self._enter()
        weakref.finalize(self, _forget, self._ids)

    def _enter(self) -> None:
        for m in self.module.modules():
            watches = _WATCHES.setdefault(id(m), weakref.WeakSet())
            if self not in watches:
                watches.add(self)
                self._ids.append(id(m))

    def added(self) -> list[str]:
        """After a mark: the names of the model's parameters not in ``known`` (empty when
        the registration added none); clears the mark."""
        self.marked = False
        self._enter()
        return [n for n, p in self.module.named_parameters() if id(p) not in self.known]

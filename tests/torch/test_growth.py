"""The registration watch behind DistributedDataParallel's ModelChangedError (serial)."""
import gc

import pytest

torch = pytest.importorskip("torch")

from hpcdp.torch import growth  # noqa: E402


def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _watch(model):
    return growth.GrowthWatch(model, {id(p) for p in model.parameters()})


def test_only_registrations_on_the_watched_model_mark_it():
    model = _model()
    watch = _watch(model)
    _model()                                        # another model's registrations
    torch.nn.Linear(2, 2).register_parameter("extra", None)
    assert not watch.marked
    model[1] = torch.nn.Tanh()                      # a module, no parameter
    assert watch.marked and watch.added() == [] and not watch.marked


def test_parameters_attached_deep_inside_or_later_inside_are_named():
    model = _model()
    watch = _watch(model)
    model[0].adapter = torch.nn.Sequential()        # a new module, empty for now
    assert watch.added() == []
    model[0].adapter.add_module("up", torch.nn.Linear(3, 4, bias=False))  # inside the new one
    assert watch.marked and watch.added() == ["0.adapter.up.weight"]
    model[2].register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    assert watch.added() == ["0.adapter.up.weight", "2.scale"]


def test_a_dropped_watch_leaves_no_entries():
    before = len(growth._WATCHES)
    model = _model()
    watch = _watch(model)
    assert len(growth._WATCHES) == before + 4       # the Sequential and its three layers
    del watch
    gc.collect()
    assert len(growth._WATCHES) == before
    model[1] = torch.nn.Tanh()                      # no watch left to mark: nothing happens

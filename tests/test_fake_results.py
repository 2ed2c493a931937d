"""``fake_values.run_fake``: the per-process memo of operators' fake output metadata gives the
values running the operator gives, misses on any changed key part (shape, strides, dtype, other
arguments, operator), and is not used for views, symbolic shapes or foreign fake tensors."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import ascend_passes.ops  # noqa: F401  (registers torch.ops.ascend)
from ascend_passes import fake_values

aten = torch.ops.aten


@pytest.fixture
def memo(monkeypatch):
    results: dict = {}
    monkeypatch.setattr(fake_values, "_RESULTS", results)
    return results


def meta(t):
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.storage_offset())


def test_hit_rebuilds_what_the_op_gives(memo):
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(4, 6, 8).transpose(0, 1)  # non-contiguous input
        w = torch.empty(8)
    first = fake_values.run_fake(torch.ops.ascend.rms_norm.default, (x, w, 1e-5), {}, mode)
    assert len(memo) == 1
    again = fake_values.run_fake(torch.ops.ascend.rms_norm.default, (x, w, 1e-5), {}, mode)
    assert len(memo) == 1
    for a, b in zip(first, again):
        assert isinstance(b, FakeTensor) and b.fake_mode is mode and b is not a
        assert meta(b) == meta(a)
    # a rebuilt value is usable under the mode like any other
    with mode:
        assert (again[0] + x).shape == x.shape


@pytest.mark.parametrize(
    "change",
    ["shape", "strides", "dtype", "scalar", "op"],
)
def test_changed_key_misses(memo, change):
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(4, 8)
        y = torch.empty(4, 8)
    fake_values.run_fake(aten.mul.Tensor, (x, y), {}, mode)
    assert len(memo) == 1
    with mode:
        if change == "shape":
            call = (aten.mul.Tensor, (torch.empty(4, 1), y))
        elif change == "strides":
            call = (aten.mul.Tensor, (torch.empty(8, 4).t(), y))
        elif change == "dtype":
            call = (aten.mul.Tensor, (x, torch.empty(4, 8, dtype=torch.float64)))
        elif change == "scalar":
            call = (aten.mul.Tensor, (x, 2.0))
        else:
            call = (aten.add.Tensor, (x, y))
        expected = call[0](*call[1])
    out = fake_values.run_fake(*call, {}, mode)
    assert len(memo) == 2  # a new entry: the first one was not reused
    assert meta(out) == meta(expected)


def test_views_symbolic_and_foreign_values_run_the_op(memo):
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(4, 8)
    view = fake_values.run_fake(aten.transpose.int, (x, 0, 1), {}, mode)
    assert view._base is x or view.untyped_storage()._cdata == x.untyped_storage()._cdata  # aliases x
    assert not memo
    other = FakeTensorMode()
    with other:
        foreign = torch.empty(4, 8)
    with pytest.raises(Exception):  # noqa: B017  (the op's own error: a tensor of another fake mode)
        fake_values.run_fake(aten.mul.Tensor, (foreign, foreign), {}, mode)
    assert not memo
    sym_mode = FakeTensorMode(shape_env=ShapeEnv())
    with sym_mode:
        s = sym_mode.from_tensor(torch.empty(4, 8), symbolic_context=None)
    sym = sym_mode.shape_env.create_unbacked_symint()
    with sym_mode:
        z = torch.empty(sym, 8)
    fake_values.run_fake(aten.mul.Tensor, (z, z), {}, sym_mode)
    assert not memo
    fake_values.run_fake(aten.mul.Tensor, (s, s), {}, sym_mode)  # static sizes: remembered
    assert len(memo) == 1

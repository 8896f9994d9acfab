"""User function registration (register_*_function) and the cast decorators."""

from __future__ import annotations

import types

import pytest
import torch
from amp_test_support import DEVICES, HALF_DTYPES

from _amp_core_helpers import tiny_mlp
from amp_core import amp


def _dtype_of(x):
    return x.dtype


def _dtypes_of(a, b):
    return (a.dtype, b.dtype)


def _o1(half, device="cpu"):
    amp.initialize(tiny_mlp().to(device), opt_level="O1", half_dtype=half, verbosity=0)


def _namespace(kind: str):
    if kind == "SimpleNamespace":
        return types.SimpleNamespace(f=_dtype_of, g=_dtype_of, pair=_dtypes_of)
    mod = types.ModuleType("amp_core_test_user_module")
    mod.f, mod.g, mod.pair = _dtype_of, _dtype_of, _dtypes_of
    return mod


NS_KINDS = ["SimpleNamespace", "ModuleType"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("kind", NS_KINDS)
def test_register_half_function(device, half, kind):
    ns = _namespace(kind)
    amp.register_half_function(ns, "f")
    _o1(half, device)
    x = torch.ones(3, device=device)
    assert ns.f(x) == half
    assert ns.g(x) == torch.float32, "only the named attribute may be wrapped"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("kind", NS_KINDS)
def test_register_float_function(device, half, kind):
    ns = _namespace(kind)
    amp.register_float_function(ns, "f")
    _o1(half, device)
    x = torch.ones(3, device=device, dtype=half)
    assert ns.f(x) == torch.float32
    assert ns.g(x) == half


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
@pytest.mark.parametrize("kind", NS_KINDS)
def test_register_promote_function(device, half, kind):
    ns = _namespace(kind)
    amp.register_promote_function(ns, "pair")
    _o1(half, device)
    f = torch.ones(3, device=device)
    h = torch.ones(3, device=device, dtype=half)
    assert ns.pair(f, h) == (torch.float32, torch.float32)
    assert ns.pair(h, f) == (torch.float32, torch.float32)
    assert ns.pair(h, h) == (half, half)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_registered_function_keeps_values(half):
    ns = types.SimpleNamespace(add=lambda a, b: a + b)
    amp.register_half_function(ns, "add")
    _o1(half)
    a, b = torch.randn(4), torch.randn(4)
    out = ns.add(a, b)
    assert out.dtype == half
    torch.testing.assert_close(out, a.to(half) + b.to(half), rtol=0, atol=0)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_registered_function_passes_non_tensors_through(half):
    ns = types.SimpleNamespace(scale=lambda t, k, *, bias=0.0: (t * k + bias, type(k), type(bias)))
    amp.register_half_function(ns, "scale")
    _o1(half)
    out, tk, tb = ns.scale(torch.ones(2), 3, bias=0.5)
    assert out.dtype == half and tk is int and tb is float
    torch.testing.assert_close(out, torch.full((2,), 3.5, dtype=half), rtol=0, atol=0)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_registered_function_inactive_without_o1(half):
    ns = _namespace("SimpleNamespace")
    amp.register_half_function(ns, "f")
    amp.initialize(tiny_mlp(), opt_level="O2", half_dtype=half, verbosity=0)
    assert ns.f(torch.ones(3)) == torch.float32


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_registered_function_inactive_after_o0_reinitialize(half):
    ns = _namespace("SimpleNamespace")
    amp.register_half_function(ns, "f")
    _o1(half)
    assert ns.f(torch.ones(3)) == half
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)
    assert ns.f(torch.ones(3)) == torch.float32


def test_register_missing_name_fails():
    ns = types.SimpleNamespace(f=_dtype_of)
    with pytest.raises((ValueError, AttributeError, RuntimeError), match=r"no_such_fn"):
        amp.register_half_function(ns, "no_such_fn")


# ---------------------------------------------------------------- decorators


@amp.half_function
def _dec_half(x):
    return x.dtype


@amp.float_function
def _dec_float(x):
    return x.dtype


@amp.promote_function
def _dec_promote(a, b):
    return (a.dtype, b.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_decorators_cast_under_o1(device, half):
    _o1(half, device)
    f = torch.ones(2, device=device)
    h = torch.ones(2, device=device, dtype=half)
    assert _dec_half(f) == half
    assert _dec_float(h) == torch.float32
    assert _dec_promote(f, h) == (torch.float32, torch.float32)
    assert _dec_promote(h, h) == (half, half)


@pytest.mark.parametrize("opt_level", ["O0", "O2", "O3"])
@pytest.mark.parametrize("half", HALF_DTYPES)
def test_decorators_do_nothing_without_o1(opt_level, half):
    amp.initialize(tiny_mlp(), opt_level=opt_level, half_dtype=half, verbosity=0)
    f = torch.ones(2)
    h = torch.ones(2, dtype=half)
    assert _dec_half(f) == torch.float32
    assert _dec_float(h) == half
    assert _dec_promote(f, h) == (torch.float32, half)


@pytest.mark.parametrize("half", HALF_DTYPES)
def test_decorators_respect_disable_casts(half):
    _o1(half)
    with amp.disable_casts():
        assert _dec_half(torch.ones(2)) == torch.float32
    assert _dec_half(torch.ones(2)) == half


def test_decorator_defined_after_initialize():
    _o1(torch.float16)

    @amp.half_function
    def late(x):
        return x.dtype

    assert late(torch.ones(2)) == torch.float16

"""amp O1's weight-cast cache sees a weight updated in place by an ``amp_C`` op.

O1 keeps low-precision copies of the weights in autocast's cast cache and drops them when a
weight's autograd version moved (amp-core's README: the cache never serves a stale copy). An
``amp_C`` op that writes a weight in place must therefore bump its version, on the compiled
CPU kernels as on the reference path (``amp_fused_ops.extensions.use_reference()``, its calls
counted).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from amp_core import amp
from amp_fused_ops import amp_C, extensions, multi_tensor_applier


@pytest.fixture(params=["compiled", "reference"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "compiled" and extensions.get_extension("cpu") is None:
        pytest.skip(f"no compiled CPU extension: {extensions.unavailable_reason('cpu')}")
    yield str(request.param)


@pytest.fixture(autouse=True)
def _amp_off_afterwards() -> object:
    yield None
    amp.initialize(torch.nn.Linear(1, 1), opt_level="O0", verbosity=0)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_o1_recasts_a_weight_scaled_in_place_by_amp_C(path: str, half: torch.dtype) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=half, verbosity=0)
    x = torch.randn(5, 6)
    first = model(x)
    flag = torch.zeros(1, dtype=torch.int32)
    lists = [[model.weight], [model.weight]]
    if path == "compiled":
        assert hasattr(extensions.get_extension("cpu"), "multi_tensor_scale")
        with torch.no_grad():
            multi_tensor_applier(amp_C.multi_tensor_scale, flag, lists, -2.0)
    else:
        with torch.no_grad(), extensions.use_reference() as calls:
            multi_tensor_applier(amp_C.multi_tensor_scale, flag, lists, -2.0)
        assert calls == {"amp_fused_ops::multi_tensor_scale": 1}
    second = model(x)
    expected = F.linear(x.to(half), model.weight.detach().to(half), model.bias.detach().to(half))
    assert not torch.equal(first, second)
    torch.testing.assert_close(second.detach(), expected, rtol=0, atol=0)

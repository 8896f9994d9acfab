"""amp.initialize with a stochastically rounding FusedAdam / FusedSGD: refused before any change.

``bf16_stochastic_round=True`` rounds the bfloat16 params themselves, so it cannot step O2's
float32 master weights nor a model cast to another dtype. ``amp.initialize`` asks the optimizer
(``amp_check_initialize``) before it casts the model or installs a hook: a refused call leaves
the model and the optimizer as they were, and the retry with fixed arguments trains.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_core import amp
from amp_optimizers import FusedAdam, FusedSGD

OPTIMIZERS = {"FusedAdam": FusedAdam, "FusedSGD": FusedSGD}

# (opt_level, half_dtype, what the message says)
REFUSED = [
    ("O2", torch.bfloat16, "cannot be combined with the float32 master weights"),
    ("O2", torch.float16, "cannot be combined with the float32 master weights"),
    ("O3", torch.float16, "would cast the model to torch.float16"),
    ("O0", torch.bfloat16, "would cast the model to torch.float32"),
]


@pytest.mark.parametrize(("opt_level", "half_dtype", "match"), REFUSED)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_refused_initialize_leaves_model_and_optimizer_as_they_were(
    name: str, opt_level: str, half_dtype: torch.dtype, match: str
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).to(torch.bfloat16)
    optimizer = OPTIMIZERS[name](model.parameters(), lr=0.1, bf16_stochastic_round=True)
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]

    with pytest.raises(ValueError, match=rf"{name}: param group 0 .*{match}.*Nothing was changed"):
        amp.initialize(model, optimizer, opt_level=opt_level, half_dtype=half_dtype, verbosity=0)

    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not hasattr(model, "_amp_state") and not hasattr(optimizer, "_amp_state")
    assert "step" not in optimizer.__dict__ and optimizer.param_groups[0]["params"] == params
    assert "master_param" not in str(optimizer.state_dict())
    for p, before in zip(model.parameters(), values, strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), before)

    # Retry with arguments it can step: pure bfloat16 (O3) on the same model and optimizer.
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O3", half_dtype=torch.bfloat16, verbosity=0
    )
    with amp.scale_loss(model(torch.randn(3, 4)).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert not all(torch.equal(p.detach(), v) for p, v in zip(params, values, strict=True))

"""The fused norms captured into a CUDA graph (or the emulator's) and replayed.

A captured forward runs again at every replay, on the values its tensors hold then. With
``memory_efficient=True`` the forward decides from the weight whether the output can stand for
the input in backward (not where a weight is zero, see ``saves_output``); that decision cannot
be taken from the values at capture (reading the weight on the host is not allowed there, and
the replays see other values), so a captured forward saves the input, as under
``torch.compile``. The replayed step must give eager's gradients, also after a weight has
become zero (and without ``memory_efficient``, where the input is saved anyway).
"""

from __future__ import annotations

import pytest
import torch

from _kernel_target import DEVICE, EMULATED, Graph, OnKernelsOf, norm_ops
from amp_fused_ops import FusedLayerNorm, FusedRMSNorm
from amp_fused_ops.normalization._ops import saves_output

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_emulation]

HIDDEN = 64
ROWS = 8


@pytest.fixture(autouse=True)
def kernels():
    """The norm ops on the CUDA sources' kernels: the emulated build's, or the GPU's."""
    norm_ops()
    if EMULATED:
        with OnKernelsOf("amp_fused_ops_emu"):
            yield
    else:
        yield


def test_a_captured_forward_does_not_read_the_weight_and_saves_the_input():
    weight = torch.ones(HIDDEN, device=DEVICE)
    assert saves_output(True, weight)  # outside a capture: read, no zero
    with Graph():
        assert not saves_output(True, weight)
        assert saves_output(True, None)  # no weight: nothing to read, the output is enough
        assert not saves_output(False, weight)


def _norm(cls: type, memory_efficient: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    norm = cls(HIDDEN, memory_efficient=memory_efficient).to(DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        if getattr(norm, "bias", None) is not None:
            norm.bias.uniform_(-0.5, 0.5)
    return norm


def _step(norm: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    norm(x).backward(dy)


def _warm_up(norm: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    """Eager steps before the capture (on a side stream on a GPU, as torch's recipe has it)."""
    if EMULATED:
        _step(norm, x, dy)
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _step(norm, x, dy)
        torch.cuda.current_stream().wait_stream(side)
    for t in (x, *norm.parameters()):
        t.grad = None


@pytest.mark.parametrize("memory_efficient", [True, False], ids=["saves_output", "saves_input"])
@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm], ids=["layer_norm", "rms_norm"])
def test_a_replayed_step_gives_eager_gradients_also_after_a_weight_turns_zero(
    cls: type, memory_efficient: bool
):
    norm = _norm(cls, memory_efficient)
    x = torch.randn(ROWS, HIDDEN, device=DEVICE, requires_grad=True)
    dy = torch.randn(ROWS, HIDDEN, device=DEVICE)
    _warm_up(norm, x, dy)
    graph = Graph()
    with graph:
        _step(norm, x, dy)

    # New input, new upstream gradient, and a weight that is now zero in one column.
    torch.manual_seed(1)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        dy.copy_(torch.randn_like(dy))
        norm.weight[3] = 0.0
    graph.replay()

    eager = _norm(cls, memory_efficient)
    eager.load_state_dict(norm.state_dict())
    x_eager = x.detach().clone().requires_grad_()
    _step(eager, x_eager, dy)
    assert torch.isfinite(x.grad).all() and torch.isfinite(norm.weight.grad).all()
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-5, atol=1e-5)
    for name, param in eager.named_parameters():
        torch.testing.assert_close(
            dict(norm.named_parameters())[name].grad, param.grad, rtol=1e-5, atol=1e-5
        )

"""Constants and small builders shared by the amp_legacy_fp16 tests (not a test module)."""

from __future__ import annotations

import torch


class MixedNet(torch.nn.Module):
    """A half first layer and an fp32 second layer: an optimizer of mixed params."""

    def __init__(self, half: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 3)
        self.fc1.to(half)
        self.low = half

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x.to(self.low)))
        return self.fc2(h.float())


def fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An fp32 reference holding the same values (half params upcast exactly)."""
    import copy

    ref = copy.deepcopy(model).float()
    if isinstance(ref, MixedNet):
        ref.low = torch.float32
    return ref


def batch(seed: int, n: int = 8, din: int = 4, dout: int = 3, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, din, generator=g)
    y = torch.randn(n, dout, generator=g)
    return x.to(device), y.to(device)


def tiny_mlp(half: torch.dtype, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return model.to(device=device, dtype=half)

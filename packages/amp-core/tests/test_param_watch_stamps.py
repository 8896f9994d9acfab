"""amp's edit stamps of the half params (``_param_watch.stamps``), read in one pass with tensor
subclasses' ``__torch_function__`` off, are the params' own: each kind of edit moves them."""

from __future__ import annotations

import torch

from amp_core._param_watch import stamp, stamps, unwatch, watch


class _Own(torch.nn.Parameter):
    """A Parameter subclass with a ``__torch_function__`` of its own (a user's)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return super().__torch_function__(func, types, args, kwargs or {})


def test_stamps_are_each_params_stamp_and_move_with_every_edit() -> None:
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)) for _ in range(3)]
    params.append(_Own(torch.zeros(4, dtype=torch.float16)))
    for p in params:
        watch(p)
    before = stamps(params)
    assert before == [stamp(p) for p in params]
    with torch.no_grad():
        params[0].fill_(1.0)  # the version counter
    params[1].data.mul_(2)  # through .data: the watched count
    params[2].data = torch.ones(4, dtype=torch.bfloat16)  # replaced
    after = stamps(params)
    assert after == [stamp(p) for p in params]
    assert [a != b for a, b in zip(after, before, strict=True)] == [True, True, True, False]
    for p in params:
        unwatch(p)

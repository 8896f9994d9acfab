"""amp.close() and re-initialize: every patch amp made is undone; O1's reach on other threads."""

from __future__ import annotations

import gc
import threading
import types
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import _global_optimizer_post_hooks

import amp_core
from _amp_core_helpers import batch, tiny_mlp
from amp_core import amp


def _user_module() -> types.ModuleType:
    ext = types.ModuleType("ext")

    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    ext.scale = scale  # type: ignore[attr-defined]
    return ext


def _process_state(ext: types.ModuleType) -> dict[str, object]:
    """What O1 changes process-wide or thread-wide."""
    return {
        "Tensor.cpu": torch.Tensor.cpu,
        "Tensor owns cpu": "cpu" in vars(torch.Tensor),
        "ext.scale": ext.scale,
        "autocast on": torch.is_autocast_enabled("cpu"),
        "autocast dtype": torch.get_autocast_dtype("cpu"),
        "softmax kernel": torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::softmax.int", "AutocastCPU"
        ),
        "optimizer step hooks": list(_global_optimizer_post_hooks),
        "casting": amp_core.o1_casting(),
    }


def _hooks(model: torch.nn.Module) -> int:
    count = 0
    for module in model.modules():
        count += len(module._forward_pre_hooks) + len(module._forward_hooks)
        count += len(module._state_dict_hooks) + len(module._load_state_dict_pre_hooks)
    return count


_PATCHED = {"step", "zero_grad", "add_param_group", "_amp_state"}


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x, y = batch(seed)
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()


def test_close_then_initialize_at_another_level_leaves_nothing_of_the_first():
    ext = _user_module()
    before = _process_state(ext)
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.register_float_function(ext, "scale")
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    _train_step(model, opt, 0)
    o1 = _process_state(ext)
    assert o1["autocast on"] and o1["softmax kernel"] and o1["casting"] is not None
    assert o1["ext.scale"] is not before["ext.scale"] and o1["Tensor owns cpu"]
    assert set(opt.__dict__) >= _PATCHED and _hooks(model) > 0

    amp.close()

    assert _process_state(ext) == before
    assert not _PATCHED & set(opt.__dict__) and "_amp_state" not in model.__dict__
    assert _hooks(model) == 0
    with (
        pytest.raises(RuntimeError, match="has not been initialized"),
        amp.scale_loss(torch.ones(()), opt),
    ):
        pass

    # The same objects at O2: only O2's patches are there, and O1's stay gone.
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    assert _process_state(ext) == before
    _train_step(model, opt, 1)
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1  # a new session's scaler
    amp.close()
    assert _process_state(ext) == before
    assert not _PATCHED & set(opt.__dict__) and _hooks(model) == 0
    amp.close()  # twice: harmless


def test_reinitialize_switches_off_the_earlier_o1_and_close_reaches_earlier_calls():
    ext = _user_module()
    before = _process_state(ext)
    amp.register_half_function(ext, "scale")
    model1, opt1 = amp.initialize(
        tiny_mlp(0),
        torch.optim.SGD(tiny_mlp(0).parameters(), lr=0.1),
        opt_level="O1",
        half_dtype=torch.bfloat16,
        verbosity=0,
    )
    model2 = tiny_mlp(1)
    model2, opt2 = amp.initialize(
        model2,
        torch.optim.SGD(model2.parameters(), lr=0.1),
        opt_level="O2",
        half_dtype=torch.bfloat16,
        verbosity=0,
    )
    # O1's process-wide patches are gone; the first call's objects keep their own.
    assert _process_state(ext) == before
    assert set(opt1.__dict__) >= _PATCHED
    amp.close()
    for opt in (opt1, opt2):
        assert not _PATCHED & set(opt.__dict__)
    assert _hooks(model1) == 0 and _hooks(model2) == 0


def test_a_scheduler_that_wrapped_the_amp_step_still_steps_after_close():
    model = tiny_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    held = opt.step  # what a wrapper built after initialize holds on to
    amp.close()
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    weight = model[0].weight.detach().clone()
    held()
    assert not torch.equal(weight, model[0].weight)  # the plain SGD step ran


def test_registrations_do_not_keep_a_module_alive():
    ext = _user_module()
    amp.register_float_function(ext, "scale")
    ref = weakref.ref(ext)
    del ext
    gc.collect()
    assert ref() is None


def _on_another_thread(fn):
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except Exception as err:
            out["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out


def _other_thread_results(ext: types.ModuleType) -> dict[str, object]:
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    target = torch.rand(4, 8, dtype=torch.bfloat16)

    def plain():
        return torch.softmax(x, -1).dtype, x.cpu().dtype, ext.scale(x).dtype

    def under_autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            softmax = torch.softmax(x, -1).dtype
            try:
                bce = F.binary_cross_entropy(torch.sigmoid(x), target).dtype
            except NotImplementedError as err:
                bce = str(err)
            return softmax, bce, ext.scale(x).dtype

    return {"plain": _on_another_thread(plain), "autocast": _on_another_thread(under_autocast)}


def test_what_o1_does_to_other_threads_is_what_the_docs_say():
    """O1 switches autocast on for its own thread only, but its policy kernels are registered
    on the process-wide dispatcher: a ``torch.autocast`` region on another thread gets Apex's
    policy (softmax in fp32, binary_cross_entropy refused) for the ops PyTorch's own autocast
    leaves alone. Nothing else reaches the other thread."""
    ext = _user_module()
    amp.register_float_function(ext, "scale")
    baseline = _other_thread_results(ext)
    amp.initialize(tiny_mlp(), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    during = _other_thread_results(ext)
    amp.close()
    after = _other_thread_results(ext)

    # Without autocast on that thread: nothing changes (Tensor.cpu and user wraps are inert).
    assert during["plain"] == baseline["plain"]
    assert during["plain"]["value"] == (torch.bfloat16, torch.bfloat16, torch.bfloat16)
    # Under torch.autocast on that thread: Apex's policy for the ops torch's CPU autocast
    # leaves alone, and the BCE refusal; user registrations are not applied there.
    softmax, bce, scaled = during["autocast"]["value"]
    assert softmax is torch.float32
    assert isinstance(bce, str) and "binary_cross_entropy" in bce
    assert scaled is torch.bfloat16
    assert baseline["autocast"]["value"][0] is torch.bfloat16  # torch's own CPU policy
    # After close, torch's own policy again.
    assert after == baseline


def test_close_reaches_a_model_whose_call_has_no_optimizer_left():
    # An inference model (no optimizer): its call is no longer live once another follows, but
    # its forward still casts inputs and outputs until amp.close().
    first = amp.initialize(tiny_mlp(0), opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    amp.initialize(tiny_mlp(1), opt_level="O3", half_dtype=torch.bfloat16, verbosity=0)
    gc.collect()
    assert _hooks(first) > 0
    amp.close()
    assert _hooks(first) == 0 and "_amp_state" not in first.__dict__
    # Back to its dtype from before initialize: a plain fp32 model (no input cast any more).
    assert all(p.dtype == torch.float32 for p in first.parameters())
    with pytest.raises(RuntimeError, match="dtype"):
        first(torch.randn(2, 4, dtype=torch.bfloat16))
    assert first(torch.randn(2, 4)).dtype == torch.float32

"""The emulator's CUDA graph: emulated kernel launches and ATen ops, captured and replayed.

:class:`Graph` is what ``torch.cuda.CUDAGraph`` is to the CUDA kernels, for the emulated
kernels of :mod:`amp_fused_ops.emulation._kernels` (the tests capture and replay the
capturable optimizers' steps through it).
"""

from __future__ import annotations

import contextlib
from typing import Any

from amp_fused_ops.emulation._kernels import OPS_NAMESPACE
from amp_fused_ops.ops import _registry as _library
from amp_fused_ops.ops._capture import emulated_capture
from amp_fused_ops.ops._reference_mode import run_overridden

__all__ = ["Graph"]


# ATen ops that launch no kernel on a GPU: a captured graph does nothing for them on replay.
_NO_KERNEL_PREFIXES = ("empty", "new_empty")


class Graph:
    """The emulator's CUDA graph: a capture of kernel launches and ATen ops, replayed in order.

    Between :meth:`__enter__` and :meth:`__exit__` the emulated kernels are recorded instead of
    run (``torch.ops.amp_emu.capture_begin``), and every ATen op that runs on this thread (the
    launchers' own ``zeros``, the float copy of an int ``step``, ...) is recorded between
    them, through a ``TorchDispatchMode``. ATen ops still run during the capture (they are
    CPU ops), so their outputs exist; :meth:`replay` runs the ops and launches again in
    capture order, writing each op's new result into the tensor it returned at capture.

    As a CUDA graph's private memory pool does, the graph holds every tensor an op of the
    capture used or returned until :meth:`reset` (or until it is garbage collected): the
    temporaries a launcher creates during the capture stay valid for the recorded launches
    that read them.
    """

    def __init__(self) -> None:
        self._segments: list[tuple[Any, ...]] = []
        self._mode: Any = None
        self._capturing = False

    def __enter__(self) -> Graph:
        import torch

        if self._capturing or self._segments:
            raise RuntimeError("this Graph already holds a capture; call reset() first")
        torch.ops.amp_emu.capture_begin()
        self._capturing = True
        self._mode = _capture_mode(self)
        self._mode.__enter__()
        self._host_reads = _host_read_mode()
        self._host_reads.__enter__()
        # What asks whether it is captured (amp_fused_ops.ops._capture) hears yes, as on a GPU.
        self._open = emulated_capture()
        self._open.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._open.__exit__(None, None, None)
        self._host_reads.__exit__(*exc)
        self._mode.__exit__(*exc)
        self._mode = None
        self._close_launches()
        self._capturing = False

    def _close_launches(self) -> None:
        import torch

        self._segments.append(("launches", torch.ops.amp_emu.capture_end()))

    def _record(self, kind: str, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        import torch

        if kind == "held":
            self._segments.append((kind, func, args, kwargs, out))
            return
        # The launches recorded so far come before this op: close them into a segment of their
        # own and open the next one.
        self._close_launches()
        self._segments.append((kind, func, args, kwargs, out))
        torch.ops.amp_emu.capture_begin()

    def replay(self) -> None:
        """Runs the captured launches and ATen ops again, in capture order."""
        import torch
        from torch.utils._pytree import tree_flatten

        if self._capturing:
            raise RuntimeError("replay() inside the capture; replay after the `with` block")
        if not self._segments:
            raise RuntimeError("nothing captured: replay() before any capture or after reset()")
        # The ops were recorded below autograd; a replay writes leaf params in place as a
        # CUDA graph's kernels do, with no autograd.
        with torch.no_grad():
            for segment in self._segments:
                self._replay_segment(segment, torch, tree_flatten)

    @staticmethod
    def _replay_segment(segment: tuple[Any, ...], torch: Any, tree_flatten: Any) -> None:
        kind = segment[0]
        if kind == "launches":
            torch.ops.amp_emu.replay(segment[1])
        elif kind == "in-place":  # writes its inputs again
            _, func, args, kwargs, _ = segment
            func(*args, **kwargs)
        elif kind == "out-of-place":  # new values into the tensors it returned at capture
            _, func, args, kwargs, out = segment
            new = func(*args, **kwargs)
            for old, value in zip(tree_flatten(out)[0], tree_flatten(new)[0], strict=True):
                if isinstance(old, torch.Tensor):
                    old.copy_(value)
        # "held": views, allocations and other ops that no kernel replays; kept alive only

    def reset(self) -> None:
        """Drops the capture and every tensor it held."""
        import torch

        for segment in self._segments:
            if segment[0] == "launches":
                torch.ops.amp_emu.reset_graph(segment[1])
        self._segments = []

    def __del__(self) -> None:
        # At interpreter shutdown the extension may be gone already.
        with contextlib.suppress(Exception):
            self.reset()


def _storages(tree: Any) -> set[int]:
    """The storage addresses of the tensors in ``tree``."""
    import torch
    from torch.utils._pytree import tree_flatten

    return {
        t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)
    }


def _replay_kind(func: Any, name: str, args: Any = (), out: Any = None) -> str:
    """How :meth:`Graph.replay` treats an op seen during a capture (see there)."""
    if func.namespace == _library.OPS_NAMESPACE:
        # A registry op with a compiled CPU kernel (opaque to the mode): replay runs it again.
        return "out-of-place"
    if func.namespace not in ("aten", "prims") or name.startswith(_NO_KERNEL_PREFIXES):
        # Other libraries' ops (the emulated norm ops): their launches were recorded as they
        # ran; the ATen ops inside them are not seen, so they run at capture only.
        return "held"
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "in-place"
    if any(r.alias_info is not None for r in schema.returns):
        # A view, unless it returned new memory (`to` with another dtype: a copy kernel). The
        # launchers of the multi-tensor ops run below autograd, where such ops come undecomposed.
        return "held" if _storages(out) & _storages(args) else "out-of-place"
    return "out-of-place"


def _runs_reference(func: Any) -> bool:
    """Whether ``func`` is an op of the registry (``torch.ops.amp_fused_ops``) that runs its
    pure-PyTorch reference on the CPU (no compiled CPU kernel is registered for it)."""
    import torch

    if func.namespace != _library.OPS_NAMESPACE:
        return False
    return not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CPU")


def _cpu_keys(torch: Any) -> Any:
    """The dispatch key set of the emulated kernels' registrations (CPU)."""
    return torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _capture_mode_class() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class CaptureMode(TorchDispatchMode):
        def __init__(self, graph: Graph) -> None:
            super().__init__()
            self.graph = graph

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            name = func._schema.name.split("::")[-1]
            if name == "_local_scalar_dense":
                raise RuntimeError(
                    f"a host synchronization ({func}, e.g. .item()) during a capture: a CUDA "
                    "graph cannot capture it; keep the value on the device"
                )
            if func.namespace == _library.OPS_NAMESPACE:
                # An override open below this mode (amp_C_on_emulated_kernels, use_reference):
                # its kernel, with this mode active, so that what it launches is recorded.
                with self:
                    done, out = run_overridden(func, args, kwargs)
                if done:
                    return out
            if func.namespace == OPS_NAMESPACE or _runs_reference(func):
                # An emulated multi-tensor op: run its kernel with this mode active, so that the
                # ATen ops of its launcher are recorded between its launches. A registry op with
                # no compiled kernel runs its reference, whose ATen ops are recorded the same
                # way (and a host sync among them raises, as it would on a GPU).
                import torch

                with self:
                    return func.redispatch(_cpu_keys(torch), *args, **kwargs)
            out = func(*args, **kwargs)
            self.graph._record(
                _replay_kind(func, name, (args, kwargs), out), func, args, kwargs, out
            )
            return out

    return CaptureMode


# Tensor methods that copy to the host without an ATen op the dispatch mode would see.
_HOST_READ_METHODS = ("tolist", "numpy")


def _host_read_mode() -> Any:
    """A function mode that raises on :data:`_HOST_READ_METHODS` (a host sync on a GPU)."""
    import torch
    from torch.overrides import TorchFunctionMode

    host_reads = {getattr(torch.Tensor, name) for name in _HOST_READ_METHODS}

    class HostReadMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func in host_reads:
                raise RuntimeError(
                    f"a host synchronization (Tensor.{func.__name__}()) during a capture: a "
                    "CUDA graph cannot capture it; keep the value on the device"
                )
            return func(*args, **(kwargs or {}))

    return HostReadMode()


def _capture_mode(graph: Graph) -> Any:
    """The dispatch mode that records a capture's ATen ops (its class made on first use)."""
    return _capture_mode_class()(graph)

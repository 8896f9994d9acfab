"""Global-memory bytes per parameter of the optimizer kernels, counted by the CUDA emulator.

No GPU needed: the CUDA kernels of ``amp-fused-ops`` run on the CPU through the emulator's
counting build (``amp_fused_ops.emulation``), which counts every kernel launch and every byte
a kernel thread reads or writes in global memory, and how many of them went through aligned
16-byte vector accesses. This is the figure that decides a memory-bound optimizer step's time
on a GPU (time ~ bytes / bandwidth), measured without one.

For every op the table gives, per parameter of one step:

- ``kernel B/p``: bytes the emulated kernels read + wrote (``vec %``: the share through 16-byte
  vector accesses);
- ``torch B/p``: bytes of the ATen ops the launcher runs around its kernels (zeroed outputs,
  flag reads, ...), estimated from the tensors each op reads and writes (a
  ``TorchDispatchMode`` sees every op; in-place and mutated arguments count as read and
  written, outputs as written, ``copy_`` / ``fill_`` / ``zero_`` targets as written only);
- ``min B/p``: the physical minimum: every input element read once, every output element
  written once (e.g. 28 for fp32 AdamW: read p, g, m, v, write p, m, v);
- ``launches``: emulated kernel launches + ATen ops, per step;
- ``torch equivalent``: what a user would run instead with PyTorch alone (e.g. grad cast +
  ``AdamW(fused=True)`` + master-to-half copy), its bytes estimated the same way from the
  ATen ops it runs on the CPU (the CUDA build runs the same ops, one kernel each; the fused
  optimizers' single op reads and writes what its schema says), and its launches.

The O2 master-weight step is amp O2's ``optimizer.step()`` with ``FusedAdam`` (the fused
master-weight kernel plus the bookkeeping around it), on a small model.

Usage:
    python benchmarks/bench_kernel_bytes.py            # (--device is accepted, ignored)

Compiles the emulated extension on first use (minutes). Prints a table and writes
``benchmarks/out/kernel_bytes.json``. Never asserts anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import amp_fused_ops
from amp_fused_ops import emulation

SIZES = (2**16, 2**15 + 3, 4099, 555, 7)  # one "model": sizes cross the vector width
CHUNK = 2048 * 32
F32, F16 = torch.float32, torch.float16

# ATen ops that launch no kernel (views, allocation, metadata).
_NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "view",
    "_unsafe_view",
    "reshape",
    "alias",
    "detach",
    "as_strided",
    "expand",
    "t",
    "transpose",
    "select",
    "slice",
    "squeeze",
    "unsqueeze",
    "lift_fresh",
    "_to_copy_noop",
    "sym_size",
    "sym_numel",
    "sym_stride",
    "is_same_size",
    "resolve_conj",
    "resolve_neg",
    "unbind",
    "_local_scalar_dense",  # a device-to-host copy of one value (a sync), not a kernel
    "_record_function_enter_new",  # the profiler's markers around optimizer.step()
    "_record_function_exit",
}
_WRITE_ONLY = {"copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_"}


def _tensors(x: Any) -> list[Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, Tensor)]


def _nbytes(ts: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class AtenTraffic(TorchDispatchMode):
    """Counts ATen ops that launch a kernel and estimates the bytes each reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0
        self.bytes = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if name in _NO_KERNEL:
            return out
        read: list[Tensor] = []
        written: list[Tensor] = []
        arguments = func._schema.arguments
        for i, argument in enumerate(arguments):
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            ts = _tensors(value)
            mutated = argument.alias_info is not None and argument.alias_info.is_write
            if mutated:
                written += ts
                if name not in _WRITE_ONLY or i > 0:
                    read += ts
            else:
                read += ts
        if not any(r.alias_info is not None for r in func._schema.returns):
            written += _tensors(out)
        # The fused optimizers' grads are declared mutable (for their grad_scale) but only
        # read when no grad_scale is given.
        if name.startswith("_fused_") and kwargs.get("grad_scale") is None:
            written = [t for t in written if all(t is not g for g in _tensors(args[1]))]
        self.launches += 1
        self.bytes += _nbytes(read) + _nbytes(written)
        self.ops[name] = self.ops.get(name, 0) + 1
        return out


@dataclass
class Row:
    op: str
    params: int
    kernel_bytes: int
    kernel_written: int
    vector_bytes: int
    kernel_launches: int
    aten_bytes: int
    aten_launches: int
    aten_ops: dict[str, int]
    minimum: float  # bytes per param
    torch_name: str
    torch_bytes: int
    torch_launches: int
    torch_ops: dict[str, int]


def _measure(step: Callable[[], None]) -> tuple[emulation.Counters, AtenTraffic]:
    step()  # warm-up: lazy state, first-call allocations
    emulation.reset_counters()
    with AtenTraffic() as traffic:
        step()
    return emulation.counters(), traffic


def _torch_only(step: Callable[[], None]) -> AtenTraffic:
    step()
    with AtenTraffic() as traffic:
        step()
    return traffic


def _randn(dtype: torch.dtype, seed: int, positive: bool = False) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=g) for n in SIZES]
    return [(t.abs() if positive else t).to(dtype) for t in out]


def _flag() -> Tensor:
    return torch.zeros(1, dtype=torch.int32)


def _adam_case(ext: Any, mode: int) -> tuple[Callable[[], None], Callable[[], None]]:
    g, p, m, v = _randn(F32, 1), _randn(F32, 2), _randn(F32, 3), _randn(F32, 4, True)

    def ours() -> None:
        ext.multi_tensor_adam(CHUNK, _flag(), [g, p, m, v], 1e-3, 0.9, 0.999, 1e-8, 3, mode, 1,
                              0.01)  # fmt: skip

    params = [t.clone().requires_grad_() for t in p]
    for q, gg in zip(params, g, strict=True):
        q.grad = gg.clone()
    optim = (torch.optim.AdamW if mode else torch.optim.Adam)(
        params, lr=1e-3, weight_decay=0.01, fused=True
    )
    return ours, optim.step


def _master_case(ext: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    g, p = _randn(F16, 1), _randn(F16, 2)
    m, v, master = _randn(F32, 3), _randn(F32, 4, True), [t.float() for t in p]
    one = torch.ones(1)

    def ours() -> None:
        ext.multi_tensor_adam_capturable_master(
            CHUNK, _flag(), [g, p, m, v, master], one, 0.9, 0.999, 1e-8, one, 1, 1, 0.01, one
        )

    # torch alone: cast the half grads into fp32 master grads, GradScaler + AdamW(fused=True)
    # on the masters (the scaler checks the grads for inf/nan, the fused step unscales), copy
    # the masters into the half params.
    masters = [t.float().requires_grad_() for t in p]
    for q in masters:
        q.grad = torch.empty_like(q)
    optim = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    scaler.scale(torch.ones(()))
    model_params = [t.clone() for t in p]

    def composition() -> None:
        torch._foreach_copy_([q.grad for q in masters], g)
        scaler.step(optim)
        scaler.update()
        torch._foreach_copy_(model_params, masters)

    return ours, composition


def _sgd_case(ext: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    g, p, mom = _randn(F32, 1), _randn(F32, 2), _randn(F32, 3)

    def ours() -> None:
        ext.multi_tensor_sgd(CHUNK, _flag(), [g, p, mom], 0.01, 0.9, 0.0, 0.1, False, False,
                             False, 1.0)  # fmt: skip

    params = [t.clone().requires_grad_() for t in p]
    for q, gg in zip(params, g, strict=True):
        q.grad = gg.clone()
    optim = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01, fused=True)
    return ours, optim.step


def _adagrad_case(ext: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    g, p, h = _randn(F32, 1), _randn(F32, 2), _randn(F32, 3, True)

    def ours() -> None:
        ext.multi_tensor_adagrad(CHUNK, _flag(), [g, p, h], 0.01, 1e-10, 1, 0.01)

    params = [t.clone().requires_grad_() for t in p]
    for q, gg in zip(params, g, strict=True):
        q.grad = gg.clone()
    optim = torch.optim.Adagrad(params, lr=0.01, weight_decay=0.01, fused=True)
    return ours, optim.step


def _lamb_case(ext: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    g, p, m, v = _randn(F32, 1), _randn(F32, 2), _randn(F32, 3), _randn(F32, 4, True)
    norm = torch.ones(1)

    def ours() -> None:
        ext.multi_tensor_lamb(CHUNK, _flag(), [g, p, m, v], 1e-3, 0.9, 0.999, 1e-6, 3, 1, 0.01,
                              1, 1, norm, 1.0)  # fmt: skip

    # torch has no LAMB: the foreach composition of torch.optim's style (Adam moments, the
    # update, per-tensor norms, the trust-ratio step).
    def composition() -> None:
        torch._foreach_lerp_(m, g, 0.1)
        torch._foreach_mul_(v, 0.999)
        torch._foreach_addcmul_(v, g, g, 0.001)
        update = torch._foreach_sqrt(v)
        torch._foreach_add_(update, 1e-6)
        update = torch._foreach_div(m, update)
        torch._foreach_add_(update, p, alpha=0.01)
        ratio = torch._foreach_div(torch._foreach_norm(p), torch._foreach_norm(update))
        torch._foreach_mul_(update, ratio)
        torch._foreach_add_(p, update, alpha=-1e-3)

    return ours, composition


def _novograd_case(ext: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    g, p, m = _randn(F32, 1), _randn(F32, 2), _randn(F32, 3)
    norms = torch.ones(len(SIZES))

    def ours() -> None:
        ext.multi_tensor_novograd(CHUNK, _flag(), [g, p, m], norms, 1e-3, 0.95, 0.98, 1e-8, 3,
                                  1, 0.01, 1, 0, 2)  # fmt: skip

    # torch has no NovoGrad: per-tensor grad norms, blended, then the foreach update.
    def composition() -> None:
        blended = torch.stack(torch._foreach_norm(g)).pow_(2).mul_(0.02).add_(norms.mul(0.98))
        denom = torch._foreach_add(torch._foreach_sqrt(list(blended.unbind())), 1e-8)
        update = torch._foreach_div(g, denom)
        torch._foreach_add_(update, p, alpha=0.01)
        torch._foreach_lerp_(m, update, 0.05)
        torch._foreach_add_(p, m, alpha=-1e-3)

    return ours, composition


def _scale_case(ext: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    x, out = _randn(F16, 1), _randn(F32, 2)

    def ours() -> None:
        ext.multi_tensor_scale(CHUNK, _flag(), [x, out], 0.5)

    found = torch.zeros(1)
    inv = torch.full((1,), 0.5)

    def composition() -> None:  # the unscale of GradScaler, on fp32 copies of the grads
        torch._foreach_copy_(out, x)
        torch._amp_foreach_non_finite_check_and_unscale_(out, found, inv)

    return ours, composition


def _axpby_case(ext: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    x, y, out = _randn(F32, 1), _randn(F32, 2), _randn(F32, 3)

    def ours() -> None:
        ext.multi_tensor_axpby(CHUNK, _flag(), [x, y, out], 2.0, 0.5, -1)

    def composition() -> None:
        torch._foreach_copy_(out, torch._foreach_add(torch._foreach_mul(x, 2.0), y, alpha=0.5))

    return ours, composition


def _l2norm_case(ext: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    x = _randn(F32, 1)

    def ours() -> None:
        ext.multi_tensor_l2norm(CHUNK, _flag(), [x], True)

    def composition() -> None:
        per = torch._foreach_norm(x)
        torch.linalg.vector_norm(torch.stack(per))

    return ours, composition


def _o2_case(ext: Any) -> tuple[Callable[[], None], Callable[[], None]]:
    """amp O2's optimizer.step() with FusedAdam on a half model (its master-weight step)."""
    import amp_core
    import amp_optimizers

    def model_and_grads() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(n, 1, bias=False) for n in SIZES))

    model = model_and_grads()
    optim = amp_optimizers.FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, optim = amp_core.amp.initialize(
        model, optim, opt_level="O2", cast_model_type=F16, loss_scale=128.0, verbosity=0
    )
    xs = [torch.randn(1, n, dtype=F16) for n in SIZES]

    def backward() -> None:
        loss = sum(layer(x).float().sum() for layer, x in zip(model, xs, strict=True))
        with amp_core.amp.scale_loss(loss, optim) as scaled:
            scaled.backward()

    def ours() -> None:
        optim.step()

    backward()
    return ours, backward


CASES: dict[str, tuple[Callable[[Any], tuple[Callable[[], None], Callable[[], None]]], float, str]]
CASES = {
    # op: (case, minimum bytes per param, torch equivalent)
    "adam (fp32, L2 decay)": (lambda e: _adam_case(e, 0), 28, "Adam(fused=True)"),
    "adamw (fp32)": (lambda e: _adam_case(e, 1), 28, "AdamW(fused=True)"),
    "master-weight adamw (fp16 g/p, fp32 master/m/v)": (
        _master_case,
        28,
        "grad cast + GradScaler + AdamW(fused) + copy",
    ),
    "sgd momentum (fp32)": (_sgd_case, 20, "SGD(momentum, fused=True)"),
    "lamb (fp32)": (_lamb_case, 28, "foreach LAMB"),
    "novograd (fp32)": (_novograd_case, 20, "foreach NovoGrad"),
    "adagrad (fp32)": (_adagrad_case, 20, "Adagrad(fused=True)"),
    "scale (fp16 -> fp32)": (_scale_case, 6, "copy + foreach unscale"),
    "axpby (fp32)": (_axpby_case, 12, "foreach mul, add, copy"),
    "l2norm (fp32, per tensor)": (_l2norm_case, 4, "foreach_norm + norm"),
}


def run() -> list[Row]:
    ext = emulation.load("counting")
    # amp_C's ops on CPU tensors run the emulated CUDA kernels (for the O2 step).
    with emulation.amp_C_on_emulated_kernels(ext):
        return _rows(ext)


def _rows(ext: Any) -> list[Row]:
    rows = []
    params = sum(SIZES)
    for op, (case, minimum, torch_name) in CASES.items():
        ours, composition = case(ext)
        counts, aten = _measure(ours)
        reference = _torch_only(composition)
        rows.append(
            Row(op, params, counts.bytes_read + counts.bytes_written, counts.bytes_written,
                counts.vector_bytes_read + counts.vector_bytes_written, counts.launches,
                aten.bytes, aten.launches, aten.ops, minimum, torch_name, reference.bytes,
                reference.launches, reference.ops)
        )  # fmt: skip
    step, backward = _o2_case(ext)
    step()  # warm-up
    backward()
    emulation.reset_counters()
    with AtenTraffic() as aten:
        step()
    counts = emulation.counters()
    o2 = Row("amp O2 step, FusedAdam (fp16 model, fp32 master/m/v)", params,
             counts.bytes_read + counts.bytes_written, counts.bytes_written,
             counts.vector_bytes_read + counts.vector_bytes_written, counts.launches,
             aten.bytes, aten.launches, aten.ops, 28, "", 0, 0, {})  # fmt: skip
    master = rows[2]
    o2.torch_name, o2.torch_bytes, o2.torch_launches, o2.torch_ops = (
        master.torch_name,
        master.torch_bytes,
        master.torch_launches,
        master.torch_ops,
    )
    rows.append(o2)
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| op | kernel B/p (read + written) | vec % | ATen B/p | total B/p | min B/p | vs min "
        "| launches | torch equivalent | torch B/p | torch launches | vs torch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        total = (r.kernel_bytes + r.aten_bytes) / r.params
        ref = r.torch_bytes / r.params
        vec = 100.0 * r.vector_bytes / r.kernel_bytes if r.kernel_bytes else 0.0
        lines.append(
            f"| {r.op} | {r.kernel_bytes / r.params:.2f} "
            f"({(r.kernel_bytes - r.kernel_written) / r.params:.1f} + "
            f"{r.kernel_written / r.params:.1f}) | {vec:.0f} | "
            f"{r.aten_bytes / r.params:.2f} | {total:.2f} | {r.minimum:g} | "
            f"{total / r.minimum:.2f}x | {r.kernel_launches} + {r.aten_launches} | "
            f"{r.torch_name} | {ref:.2f} | {r.torch_launches} | "
            f"{total / ref if ref else float('nan'):.2f}x |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="ignored: the emulator runs on the CPU")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device != "cpu":
        print("bench_kernel_bytes: the emulated kernels run on the CPU only; nothing to do")
        return 0
    torch.set_num_threads(1)
    rows = run()
    print(
        f"Global-memory bytes per parameter of one step ({sum(SIZES)} params in {len(SIZES)} "
        f"tensors), counted on the emulated CUDA kernels; torch {torch.__version__}, "
        f"amp_fused_ops {amp_fused_ops.__version__}, Python {platform.python_version()}, "
        f"{datetime.date.today()}"
    )
    print(table(rows))
    for r in rows:
        print(f"  {r.op}: ATen ops {r.aten_ops}; torch equivalent ops {r.torch_ops}")
    out = Path(__file__).resolve().parent / "out" / "kernel_bytes.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kernel launches and thread blocks per optimizer step of a 1.3B-parameter GPT, on the emulator.

No GPU needed: the fused optimizers' ``optimizer.step()`` and amp's scaler ops run the CUDA
kernels of ``amp-fused-ops`` on the CPU through the emulator's counting build, which counts
every launch and the blocks of its grid. The model is the tensor list of a GPT-style
transformer of 1.3B parameters (24 layers, hidden 2048, vocabulary 50257, context 2048, MLP
4 x hidden, biases and LayerNorm weights, the output layer tied to the embedding): 292 tensors,
1,315,723,264 parameters.

Method (the counts are exact, the data is small): a multi-tensor launcher's launches and blocks
depend only on the number of tensors and on each tensor's chunk count ``ceil(numel / chunk)``.
The script divides the chunk size (2048 * 32 by default) and every tensor's size by the same
factor ``k``, rounding sizes up: ``ceil(ceil(n / k) / (chunk / k)) == ceil(n / chunk)`` for any
``n`` when ``k`` divides the chunk size, so every tensor keeps its chunk count and the list keeps
its length, while the step allocates ``1 / k`` of the data (k = 4096: 321K elements instead of
1.3G). The launches run in the emulator's count-only mode
(:func:`amp_fused_ops.emulation.count_launches_only`): each launch is checked and its blocks
counted, none of its threads runs (the emulator runs about 200 blocks a second, and a step of
this model has 20,261 blocks per pass over the data). ``--run-kernels`` runs them instead, to
check on a smaller model (``--layers 12 --hidden 256``) that both modes count the same: no
host decision in these steps depends on a kernel's result. Bytes are not comparable at the
reduced sizes (``bench_kernel_bytes.py`` counts them on real sizes).

Columns, per ``optimizer.step()`` (after one warm-up step) or per op call:

- ``launches`` / ``blocks``: what the emulated kernels launched;
- ``one-tensor launches`` / ``min blocks``: the same step on one tensor holding all the
  model's elements: one launch per kernel the algorithm needs, and ``ceil(total / chunk)``
  blocks per pass over the data (the floors no metadata layout can beat);
- ``ATen ops``: kernel-launching ATen ops the step runs besides (state, scalars, flags).

Usage:
    python benchmarks/count_launches.py [--scale 4096] [--chunk-size 65536] [--baseline old.json]

Prints a table and writes ``benchmarks/out/count_launches.json``. Never asserts anything.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import amp_fused_ops
import amp_optimizers
from amp_fused_ops import amp_C, emulation, multi_tensor_applier

CHUNK = 2048 * 32
Shape = tuple[int, ...]

# ATen ops that launch no kernel on a GPU (views, allocation, metadata, host reads).
_NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view",
    "_unsafe_view", "reshape", "alias", "detach", "as_strided", "expand", "t", "transpose",
    "select", "slice", "squeeze", "unsqueeze", "lift_fresh", "sym_size", "sym_numel",
    "sym_stride", "is_same_size", "resolve_conj", "resolve_neg", "unbind",
    "_local_scalar_dense", "_record_function_enter_new", "_record_function_exit",
}  # fmt: skip


def gpt_shapes(
    layers: int = 24, hidden: int = 2048, vocab: int = 50257, context: int = 2048, mlp: int = 4
) -> list[Shape]:
    """Parameter shapes of a GPT-2-style model, in ``model.parameters()`` order."""
    shapes: list[Shape] = [(vocab, hidden), (context, hidden)]  # token, position embeddings
    for _ in range(layers):
        shapes += [
            (hidden,), (hidden,),  # LayerNorm 1 weight, bias
            (3 * hidden, hidden), (3 * hidden,),  # attention qkv
            (hidden, hidden), (hidden,),  # attention output
            (hidden,), (hidden,),  # LayerNorm 2
            (mlp * hidden, hidden), (mlp * hidden,),  # MLP in
            (hidden, mlp * hidden), (hidden,),  # MLP out
        ]  # fmt: skip
    shapes += [(hidden,), (hidden,)]  # final LayerNorm; the output layer is the embedding
    return shapes


def scaled_sizes(shapes: Sequence[Shape], scale: int) -> list[int]:
    """Each tensor's element count divided by ``scale``, rounded up (chunk counts preserved)."""
    return [-(-math.prod(s) // scale) for s in shapes]


class AtenOps(TorchDispatchMode):
    """Counts the ATen ops that launch a kernel (the emulated kernels' own ops are not ATen)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name.startswith("aten::") and name.split("::")[-1] not in _NO_KERNEL:
            self.count += 1
        return out


@dataclass
class Row:
    case: str
    tensors: int
    launches: int
    blocks: int
    aten_ops: int
    one_tensor_launches: int
    min_blocks: int


def _params(sizes: Sequence[int], dtype: torch.dtype) -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    params = []
    for n in sizes:
        p = torch.randn(n, generator=g).to(dtype).requires_grad_()
        p.grad = (torch.randn(n, generator=g) * 1e-2).to(dtype)
        params.append(p)
    return params


def _optimizer_step(make: Callable[[list[Tensor]], Any], dtype: torch.dtype) -> Callable:
    def build(sizes: Sequence[int]) -> Callable[[], None]:
        optimizer = make(_params(sizes, dtype))
        return optimizer.step

    return build


def _op_call(
    prepare: Callable[[list[Tensor]], Callable[[Tensor], Any]], dtype: torch.dtype
) -> Callable:
    """A case that calls an op on the model's tensors; ``prepare`` allocates what it needs."""

    def build(sizes: Sequence[int]) -> Callable[[], None]:
        call = prepare([p.detach() for p in _params(sizes, dtype)])
        flag = torch.zeros(1, dtype=torch.int32)
        return lambda: call(flag)

    return build


def _unscale(tensors: list[Tensor]) -> Callable[[Tensor], Any]:
    # O2's unscale: the fp16 grads into fp32 master grads, checked for inf / nan.
    masters = [torch.zeros_like(t, dtype=torch.float32) for t in tensors]
    return lambda flag: multi_tensor_applier(
        amp_C.multi_tensor_scale, flag, [tensors, masters], 1.0 / 65536
    )


def _unscale_stashed(tensors: list[Tensor]) -> Callable[[Tensor], Any]:
    # Unscale while accumulating into stashed fp32 grads: out = unscale * new + 1 * stashed.
    stashed = [torch.zeros_like(t, dtype=torch.float32) for t in tensors]
    return lambda flag: multi_tensor_applier(
        amp_C.multi_tensor_axpby, flag, [tensors, stashed, stashed], 1.0 / 65536, 1.0, 0
    )


def _l2norm(tensors: list[Tensor]) -> Callable[[Tensor], Any]:
    return lambda flag: multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [tensors], True)


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CASES: dict[str, Callable[[Sequence[int]], Callable[[], None]]] = {
    "FusedAdam (fp32)": _optimizer_step(lambda p: amp_optimizers.FusedAdam(p), F32),
    "FusedAdam capturable (fp32)": _optimizer_step(
        lambda p: amp_optimizers.FusedAdam(p, capturable=True), F32
    ),
    "FusedAdam master weights (bf16)": _optimizer_step(
        lambda p: amp_optimizers.FusedAdam(p, master_weights=True), BF16
    ),
    "FusedSGD momentum (fp32)": _optimizer_step(
        lambda p: amp_optimizers.FusedSGD(p, lr=0.1, momentum=0.9), F32
    ),
    "FusedLAMB (fp32)": _optimizer_step(lambda p: amp_optimizers.FusedLAMB(p), F32),
    "FusedNovoGrad (fp32)": _optimizer_step(lambda p: amp_optimizers.FusedNovoGrad(p), F32),
    "FusedAdagrad (fp32)": _optimizer_step(lambda p: amp_optimizers.FusedAdagrad(p), F32),
    "FusedMixedPrecisionLamb (bf16)": _optimizer_step(
        lambda p: amp_optimizers.FusedMixedPrecisionLamb(p), BF16
    ),
    "unscale: multi_tensor_scale (fp16 -> fp32)": _op_call(_unscale, F16),
    "unscale into stashed grads: multi_tensor_axpby (fp16, fp32 -> fp32)": _op_call(
        _unscale_stashed, F16
    ),
    "multi_tensor_l2norm (fp32, per tensor)": _op_call(_l2norm, F32),
}


def _count(step: Callable[[], None], run_kernels: bool) -> tuple[int, int, int]:
    mode = contextlib.nullcontext() if run_kernels else emulation.count_launches_only()
    with mode:
        step()  # warm-up: lazy state
        emulation.reset_counters()
        with AtenOps() as aten:
            step()
    counts = emulation.counters()
    return counts.launches, counts.blocks, aten.count


def run(shapes: Sequence[Shape], scale: int, cases: Sequence[str], run_kernels: bool) -> list[Row]:
    sizes = scaled_sizes(shapes, scale)
    one = [-(-sum(math.prod(s) for s in shapes) // scale)]
    rows = []
    ext = emulation.load("counting")
    with emulation.amp_C_on_emulated_kernels(ext):
        for case in cases:
            launches, blocks, aten = _count(CASES[case](sizes), run_kernels)
            one_launches, one_blocks, _ = _count(CASES[case](one), run_kernels)
            rows.append(Row(case, len(sizes), launches, blocks, aten, one_launches, one_blocks))
    return rows


def comparison(rows: Sequence[Row], baseline: Sequence[Row]) -> str:
    """Launches and blocks of ``rows`` beside those of a ``baseline`` run (``--baseline``)."""
    before = {r.case: r for r in baseline}
    lines = [
        "| case | launches before | launches | one-tensor launches | blocks before | blocks "
        "| min blocks |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = before.get(r.case)
        launches, blocks = (b.launches, b.blocks) if b else ("-", "-")
        lines.append(
            f"| {r.case} | {launches} | {r.launches} | {r.one_tensor_launches} | {blocks} | "
            f"{r.blocks} | {r.min_blocks} |"
        )
    return "\n".join(lines)


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| case | tensors | launches | one-tensor launches | blocks | min blocks | blocks / min "
        "| ATen ops |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r.blocks / r.min_blocks if r.min_blocks else float("nan")
        lines.append(
            f"| {r.case} | {r.tensors} | {r.launches} | {r.one_tensor_launches} | {r.blocks} | "
            f"{r.min_blocks} | {ratio:.3f} | {r.aten_ops} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=4096, help="size divisor k (default 4096)")
    parser.add_argument("--chunk-size", type=int, default=CHUNK, help="elements per chunk")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument(
        "--run-kernels", action="store_true", help="run the kernels (default: count only)"
    )
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default out/)")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="the JSON of an earlier run (another build): also print its counts beside these",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.chunk_size % args.scale:
        print(f"--scale {args.scale} must divide --chunk-size {args.chunk_size}")
        return 2
    torch.set_num_threads(1)
    # As on a GPU, an op without a CUDA kernel takes the reference, not the C++ CPU kernels.
    os.environ.setdefault("AMP_FUSED_OPS_DISABLE", "cpu")
    shapes = gpt_shapes(args.layers, args.hidden, args.vocab, args.context)
    previous = multi_tensor_applier.chunk_size
    multi_tensor_applier.chunk_size = args.chunk_size // args.scale
    try:
        rows = run(shapes, args.scale, args.cases, args.run_kernels)
    finally:
        multi_tensor_applier.chunk_size = previous
    total = sum(math.prod(s) for s in shapes)
    print(
        f"Launches and blocks per step, GPT ({args.layers} layers, hidden {args.hidden}: "
        f"{len(shapes)} tensors, {total:,} params, chunk {args.chunk_size}), counted on the "
        f"emulated CUDA kernels ({'run' if args.run_kernels else 'count-only'}) at sizes / "
        f"{args.scale}; torch {torch.__version__}, amp_fused_ops {amp_fused_ops.__version__}, "
        f"Python {platform.python_version()}, {datetime.date.today()}"
    )
    print(table(rows))
    if args.baseline is not None:
        baseline = [Row(**r) for r in json.loads(args.baseline.read_text())["rows"]]
        print(f"\nBeside the counts of {args.baseline}:")
        print(comparison(rows, baseline))
    out = args.out or Path(__file__).resolve().parent / "out" / "count_launches.json"
    out.parent.mkdir(exist_ok=True)
    record = {"scale": args.scale, "chunk_size": args.chunk_size, "params": total,
              "shapes": [list(s) for s in shapes], "run_kernels": args.run_kernels}  # fmt: skip
    out.write_text(json.dumps({**record, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

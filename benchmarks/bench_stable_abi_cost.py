"""Per-call host cost of a multi-tensor op on PyTorch's stable ABI against the same op on ATen's.

The compiled modules of amp-fused-ops use ATen's C++ API. PyTorch's stable ABI would let one
prebuilt module load into every torch from 2.11 on, at a cost per call that this script
measures on the CPU (where the host cost is all there is to a call on tiny tensors). The op
(``stable_abi_cost/``) has the arguments of ``multi_tensor_adam`` (four lists of tensors and
ten scalars), checks every tensor as a real op does (dtype, layout, device, size) and makes a
trivial update. Variants, called through ``torch.ops`` on four lists of N float32 tensors of 4
elements, interleaved round by round:

- ``aten``: the op on ATen's API (``TORCH_LIBRARY``, ``at::TensorList``);
- ``stable``: the same op on the stable ABI (``STABLE_TORCH_LIBRARY``, ``TORCH_BOX``,
  ``std::vector<torch::stable::Tensor>``), compiled with ``TORCH_TARGET_VERSION`` = 2.11;
- ``stable + bumps``: ``stable`` with a Python ``ADInplaceOrView`` kernel that increments the
  version counters of the four lists and redispatches (what ``torch.library.custom_op`` does
  for a mutating op; the stable ABI has no C++ call for it, and amp-fused-ops' ops bump the
  counters of what they write);
- ``aten (empty)`` / ``stable (empty)``: the same arguments into an empty body (the call and
  the passing of the arguments alone);
- ``amp_fused_ops``: ``torch.ops.amp_fused_ops.multi_tensor_adam``, the real op (its own checks
  and Adam math), when its CPU module is built or compiles.

Prints, per N, the median and minimum microseconds per call of each variant and the version
counters each variant bumps. The two test modules compile on first use into ``--build-dir``.
``--stable-include`` puts another torch's headers first for the stable module (e.g. torch
2.11's, extracted from its wheel: proof that only 2.11's API is used); by default the installed
torch's headers compile it, which refuse anything newer than the target version.

    python benchmarks/bench_stable_abi_cost.py [--tensors 1 100 1000] [--rounds 9]

``--device cuda`` (``nox -s bench`` passes it on a GPU machine) says so and measures nothing.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import cpu_flags, default_threads, format_cpu_flags, load_average

LOG = logging.getLogger("bench_stable_abi_cost")
SOURCES = Path(__file__).resolve().parent / "stable_abi_cost"
TARGET_2_11 = "0x020b000000000000"  # (2 << 56) | (11 << 48): torch 2.11
SCALARS = (1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
LISTS = ("grads", "params", "exp_avgs", "exp_avg_sqs")


def build(build_dir: Path, stable_include: str | None) -> None:
    """Compiles and loads both test modules (their ops appear under torch.ops)."""
    from torch.utils import cpp_extension

    common = {"is_python_module": False, "extra_cflags": ["-O2"], "verbose": False}
    for name, source, extra in (
        ("amp_abi_cost_aten", "aten_op.cpp", {}),
        (
            "amp_abi_cost_stable",
            "stable_op.cpp",
            {
                "extra_cflags": ["-O2", f"-DTORCH_TARGET_VERSION={TARGET_2_11}"],
                "extra_include_paths": [stable_include] if stable_include else [],
            },
        ),
    ):
        folder = build_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        path = cpp_extension.load(
            name=name,
            sources=[str(SOURCES / source)],
            build_directory=str(folder),
            **{**common, **extra},
        )
        torch.ops.load_library(path)


def bump_then_redispatch() -> torch.library.Library:
    """A Python ADInplaceOrView kernel for the third variant: the version counters of the
    four lists, then the op below ADInplaceOrView. The kernel stays registered while the
    returned library lives."""
    op = torch.ops.amp_abi_cost_stable_bumped.adam_like.default
    after = torch._C._after_ADInplaceOrView_keyset
    increment = torch._C._increment_version

    def kernel(keyset: Any, chunk: int, flag: torch.Tensor, *args: Any) -> None:
        for tensors in args[:4]:
            increment(tensors)
        op.redispatch(keyset & after, chunk, flag, *args)

    library = torch.library.Library("amp_abi_cost_stable_bumped", "IMPL")
    library.impl("adam_like", kernel, "ADInplaceOrView", with_keyset=True)
    return library


def variants() -> dict[str, Callable[..., Any]]:
    found = {
        "aten": torch.ops.amp_abi_cost_aten.adam_like,
        "stable": torch.ops.amp_abi_cost_stable.adam_like,
        "stable + bumps": torch.ops.amp_abi_cost_stable_bumped.adam_like,
        "aten (empty)": torch.ops.amp_abi_cost_aten.empty_body,
        "stable (empty)": torch.ops.amp_abi_cost_stable.empty_body,
    }
    try:
        from amp_fused_ops import extensions
    except ImportError as error:
        LOG.info("amp_fused_ops unavailable (%s): its row is left out", error)
        return found
    if extensions.get_extension("cpu") is None:  # builds it if it can
        LOG.info("amp_fused_ops' CPU module: %s; its row is left out",
                 extensions.unavailable_reason("cpu"))  # fmt: skip
    else:
        found["amp_fused_ops"] = torch.ops.amp_fused_ops.multi_tensor_adam
    return found


def lists(n: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    return [[torch.randn(4, generator=g) * 1e-3 for _ in range(n)] for _ in LISTS]


def version_bumps(ops: dict[str, Callable[..., Any]]) -> dict[str, list[str]]:
    """Which lists each variant's call bumps the version counters of."""
    bumped = {}
    for name, op in ops.items():
        tensors = lists(3)
        before = [[t._version for t in ts] for ts in tensors]
        op(65536, torch.zeros(1, dtype=torch.int32), *tensors, *SCALARS)
        bumped[name] = [
            list_name
            for list_name, ts, was in zip(LISTS, tensors, before, strict=True)
            if all(t._version > v for t, v in zip(ts, was, strict=True))
        ]
    return bumped


def check_results(ops: dict[str, Callable[..., Any]]) -> None:
    """The three test ops make the same update (p -= lr * g)."""
    for name in ("aten", "stable", "stable + bumps"):
        grads, params, *state = lists(5)
        want = [p - SCALARS[0] * g for g, p in zip(grads, params, strict=True)]
        ops[name](65536, torch.zeros(1, dtype=torch.int32), grads, params, *state, *SCALARS)
        for got, expected in zip(params, want, strict=True):
            torch.testing.assert_close(got, expected, msg=name)


def time_calls(
    ops: dict[str, Callable[..., Any]], n: int, calls: int, rounds: int
) -> dict[str, list[float]]:
    """Microseconds per call of every variant, one entry per round, rounds interleaved."""
    args = (65536, torch.zeros(1, dtype=torch.int32), *lists(n), *SCALARS)
    for op in ops.values():
        for _ in range(max(10, calls // 5)):
            op(*args)
    times: dict[str, list[float]] = {name: [] for name in ops}
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            for name, op in ops.items():
                start = time.perf_counter()
                for _ in range(calls):
                    op(*args)
                times[name].append((time.perf_counter() - start) / calls * 1e6)
    finally:
        gc.enable()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tensors", type=int, nargs="+", default=[1, 100, 1000])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=300000, help="tensors x calls per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--build-dir", type=Path, default=None)
    parser.add_argument("--stable-include", default=None, help="headers first for stable_op.cpp")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.device != "cpu":
        print("bench_stable_abi_cost: the test ops have CPU kernels only (the host cost of a call)")
        return 0
    torch.set_num_threads(args.threads or default_threads())
    build_dir = args.build_dir or Path(tempfile.mkdtemp(prefix="amp_abi_cost_"))
    build(build_dir, args.stable_include)
    library = bump_then_redispatch()  # noqa: F841  (registered while it lives)
    ops = variants()
    check_results(ops)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU flags: "
          f"{format_cpu_flags(cpu_flags())}")  # fmt: skip
    print("version counters bumped by one call:")
    for name, bumped in version_bumps(ops).items():
        print(f"    {name:<16}{', '.join(bumped) or 'none'}")
    for n in args.tensors:
        calls = max(100, args.calls // (4 * n))
        before = load_average()
        times = time_calls(ops, n, calls, args.rounds)
        print(f"\n{n} tensor(s) per list, 4 lists; {args.rounds} rounds of {calls} calls; "
              f"load average {before} to {load_average()}")  # fmt: skip
        base = statistics.median(times["aten"])
        print(f"    {'variant':<16}{'median us':>11}{'min us':>9}{'vs aten':>9}")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"    {name:<16}{median:>11.2f}{min(values):>9.2f}{median / base:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Host cost per op of amp O1 against torch.autocast: one call of each op O1's policy covers.

amp O1 runs on PyTorch's autocast: where PyTorch's own autocast kernel already applies Apex's
policy to an op on a device, O1 adds nothing to its call; where it does not (CPU autocast
leaves ``softmax``, ``exp``, ``sum``, the losses ... in the half dtype; CUDA autocast leaves
``std`` / ``var``, the promoting ops ...), amp-core registers an autocast kernel of its own,
in Python, which casts the inputs (to float32, or to the widest dtype) and calls the op again
below autocast. That Python kernel is O1's per-op host cost, and this script lists it.

For each op below, called on small float32 tensors (so that the host's work is the time), the
time of a call under ``torch.autocast`` alone and under amp O1 (``amp.initialize`` at O1 on
the same device and half dtype; ``amp.close()`` after), the two interleaved by rounds: the
mean over a round's calls, the least of the rounds (the least disturbed by other work),
and how O1 treats the op on this device: ``torch`` (PyTorch's autocast kernel), ``policy``
(amp-core's Python kernel), ``method`` (a Tensor method wrapped in Python). Ops that neither
autocast touches (their inputs are float32 already and the op has no autocast rule) are left
out: the list is of the ops O1 casts.

Usage:
    python benchmarks/bench_o1_ops.py --device cpu      # bfloat16 by default on the CPU
    python benchmarks/bench_o1_ops.py --device cuda --half-dtype float16
    python benchmarks/bench_o1_ops.py --device cuda --list  # how O1 treats each op, no timing

Prints a table and writes ``benchmarks/out/o1_ops_<device>.json``. Never asserts a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import amp_core
from _common import default_threads, device_name, load_average, sync
from amp_core import POLICY, amp

DEFAULT_OUT_DIR = Path(__file__).resolve().parent / "out"

Inputs = dict[str, Tensor]
# name -> (the overload of the aten op it calls, as its autocast kernel is keyed, the call)
OPS: dict[str, tuple[str, Callable[[Inputs], object]]] = {
    "linear": ("aten::linear", lambda t: F.linear(t["x"], t["w"])),
    "matmul": ("aten::matmul", lambda t: t["x"] @ t["w"]),
    "bmm": ("aten::bmm", lambda t: torch.bmm(t["b"], t["b"])),
    "conv2d": ("aten::conv2d", lambda t: F.conv2d(t["img"], t["kernel"])),
    "softmax": ("aten::softmax.int", lambda t: torch.softmax(t["x"], -1)),
    "log_softmax": ("aten::log_softmax.int", lambda t: torch.log_softmax(t["x"], -1)),
    "layer_norm": ("aten::layer_norm", lambda t: F.layer_norm(t["x"], (t["x"].shape[-1],))),
    "group_norm": ("aten::group_norm", lambda t: F.group_norm(t["img"], 1)),
    "exp": ("aten::exp", lambda t: torch.exp(t["x"])),
    "log": ("aten::log", lambda t: torch.log(t["pos"])),
    "pow": ("aten::pow.Tensor_Scalar", lambda t: t["x"].pow(2)),
    "sum": ("aten::sum", lambda t: t["x"].sum()),
    "cumsum": ("aten::cumsum", lambda t: torch.cumsum(t["x"], -1)),
    "norm": ("aten::linalg_vector_norm", lambda t: t["x"].norm()),
    "std": ("aten::std.correction", lambda t: t["x"].std()),
    "mse_loss": ("aten::mse_loss", lambda t: F.mse_loss(t["x"], t["y"])),
    "cross_entropy": ("aten::cross_entropy_loss", lambda t: F.cross_entropy(t["x"], t["labels"])),
    "nll_loss": ("aten::nll_loss_nd", lambda t: F.nll_loss(t["x"], t["labels"])),
    "interpolate": (
        "aten::upsample_nearest2d.vec",
        lambda t: F.interpolate(t["img"], scale_factor=2.0, mode="nearest"),
    ),
    "addcmul": ("aten::addcmul", lambda t: torch.addcmul(t["x"], t["x"], t["y"])),
    "cat": ("aten::cat", lambda t: torch.cat([t["x"], t["y"]])),
    "stack": ("aten::stack", lambda t: torch.stack([t["x"], t["y"]])),
    "Tensor.cpu": ("Tensor.cpu", lambda t: t["x"].cpu()),
}


def make_inputs(device: str) -> Inputs:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    return {
        "x": rand(8, 16),
        "y": rand(8, 16),
        "pos": rand(8, 16).abs() + 0.1,
        "w": rand(16, 16),
        "b": rand(4, 8, 8),
        "img": rand(2, 4, 8, 8),
        "kernel": rand(4, 4, 3, 3),
        "labels": torch.randint(0, 16, (8,), generator=gen).to(device),
    }


def policy_ops(device: str) -> dict[str, str]:
    """``{op overload: cast}`` of the ops of ``OPS`` that O1 gives a Python autocast kernel on
    ``device``: the ops of :data:`amp_core.POLICY` (by name) for which PyTorch registers no
    autocast kernel of its own (read before O1 switches on), as ``amp.initialize`` does."""
    key = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}[device]
    cast_of = {name: cast.value for cast, names in POLICY.items() for name in names}
    found = {}
    for qualified, _ in OPS.values():
        if not qualified.startswith("aten::"):
            continue
        name = qualified.removeprefix("aten::").split(".")[0]
        if name in cast_of and not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key):
            found[qualified] = cast_of[name]
    return found


def time_calls(call: Callable[[], object], device: str, calls: int) -> float:
    """Microseconds per call over ``calls`` calls (the device synchronized around them)."""
    call()
    sync(device)
    begin = time.perf_counter()
    for _ in range(calls):
        call()
    sync(device)
    return (time.perf_counter() - begin) / calls * 1e6


def treatment(device: str) -> dict[str, str]:
    """How O1 treats each op of :data:`OPS` on ``device``: ``torch``, ``policy (<cast>)`` or
    ``method``. Read from PyTorch's registrations alone, so it needs no such device here."""
    policy = policy_ops(device)
    how = {}
    for name, (op, _) in OPS.items():
        if op.startswith("Tensor."):  # O1 wraps Tensor.cpu in Python (docs/opt_levels.rst)
            how[name] = "method"
        elif op in policy:
            how[name] = f"policy ({policy[op]})"
        else:
            how[name] = "torch"
    return how


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    inputs = make_inputs(args.device)
    half = getattr(torch, args.half_dtype)
    how = treatment(args.device)
    autocast_us: dict[str, list[float]] = {name: [] for name in OPS}
    o1_us: dict[str, list[float]] = {name: [] for name in OPS}

    def bound(call: Callable[[Inputs], object]) -> Callable[[], object]:
        return lambda: call(inputs)

    for _ in range(args.rounds):
        with torch.autocast(args.device, dtype=half):
            for name, (_, call) in OPS.items():
                autocast_us[name].append(time_calls(bound(call), args.device, args.calls))
        model = torch.nn.Linear(16, 16).to(args.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, optimizer, opt_level="O1", verbosity=0, half_dtype=half)
        try:
            for name, (_, call) in OPS.items():
                o1_us[name].append(time_calls(bound(call), args.device, args.calls))
        finally:
            amp.close()
    rows = []
    for name, (op, _) in OPS.items():
        a, o = min(autocast_us[name]), min(o1_us[name])
        rows.append({"op": name, "aten": op, "o1": how[name], "autocast_us": a, "o1_us": o})
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    columns = f"{'op':<15}{'O1 adds':<18}{'autocast us':>12}{'O1 us':>9}{'extra us':>10}"
    lines = [columns, "-" * len(columns)]
    for r in rows:
        a, o = float(r["autocast_us"]), float(r["o1_us"])  # type: ignore[arg-type]
        lines.append(f"{r['op']!s:<15}{r['o1']!s:<18}{a:>12.1f}{o:>9.1f}{o - a:>10.1f}")
    policy = [r for r in rows if str(r["o1"]).startswith(("policy", "method"))]
    if policy:
        extra = statistics.median(float(r["o1_us"]) - float(r["autocast_us"]) for r in policy)  # type: ignore[arg-type]
        lines.append(
            f"{len(policy)} of {len(rows)} ops take a Python kernel of O1 on this device; "
            f"median extra host time per call: {extra:.1f} us"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--half-dtype", choices=("bfloat16", "float16"), default=None,
        help="default: bfloat16 on cpu, float16 on cuda",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="calls per op and round")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument(
        "--list", action="store_true",
        help="only list how O1 treats each op on --device (no timing; no such device needed)",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        how = treatment(args.device)
        print(f"how amp O1 treats each op on {args.device}, torch {torch.__version__}:")
        for name, (op, _) in OPS.items():
            print(f"    {name:<15}{op:<32}{how[name]}")
        taken = sum(h != "torch" for h in how.values())
        print(f"{taken} of {len(how)} ops take a Python kernel of O1 on {args.device}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_o1_ops: CUDA is not available; nothing timed on cuda.")
        return 0
    if args.half_dtype is None:
        args.half_dtype = "bfloat16" if args.device == "cpu" else "float16"
    torch.set_num_threads(args.threads if args.threads is not None else default_threads())
    rows = run(args)
    print(
        f"{device_name(args.device)} ({args.device}), {args.half_dtype}, "
        f"torch {torch.__version__}, amp_core {amp_core.__version__}, "
        f"{torch.get_num_threads()} threads; "
        f"{args.rounds} rounds of {args.calls} calls per op; load average {load_average()}"
    )
    print(format_table(rows))
    record = {
        "benchmark": "o1_ops",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "device_name": device_name(args.device),
        "half_dtype": args.half_dtype,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "calls": args.calls,
        "ops": rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"o1_ops_{args.device}.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

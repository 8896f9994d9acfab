"""What the benchmark scripts share: timing, the copy-bandwidth yardstick, device facts.

The scripts import this module as a sibling (``python benchmarks/bench_x.py`` puts this folder
first on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

Step = Callable[[], None]


def sync(device: str) -> None:
    """Wait for the device (CUDA); a no-op on CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


def time_step(step: Step, device: str, warmup: int, iters: int) -> list[float]:
    """Milliseconds per call of ``step`` after ``warmup`` untimed calls.

    CUDA events around each call on a GPU, ``time.perf_counter`` on CPU.
    """
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            step()
            times.append((time.perf_counter() - begin) * 1e3)
    return times


def with_env(variable: str, value: str, step: Step) -> Step:
    """``step`` with the environment variable ``variable`` set to ``value`` around each call
    (for the kernels' variant switches, read at every call), restored after."""

    def run() -> None:
        previous = os.environ.get(variable)
        os.environ[variable] = value
        try:
            step()
        finally:
            if previous is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = previous

    return run


def host_time_step(step: Step, device: str, warmup: int, iters: int) -> list[float]:
    """Milliseconds of host time per call of ``step``: ``time.perf_counter`` around each call,
    the device synchronized after it, outside the timing. On a GPU this is what the host takes
    to issue the step (its Python, the dispatcher, the launches) onto an idle device; on the CPU,
    where the kernels run in the call, the same as :func:`time_step`.
    """
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(iters):
        begin = time.perf_counter()
        step()
        times.append((time.perf_counter() - begin) * 1e3)
        sync(device)
    return times


def graph_time_step(step: Step, warmup: int, iters: int) -> list[float]:
    """Milliseconds of device time per call of ``step`` (CUDA only): the step captured once in
    a CUDA graph, each replay timed with events, so no host work runs between its kernels.

    Raises what the capture raises (a step that synchronizes with the host cannot be captured).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        for _ in range(max(warmup, 3)):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def copy_bandwidth(device: str, params: int, iters: int) -> float:
    """GB/s of ``dst.copy_(src)`` on fp32 buffers (bytes read + written), up to 256M floats."""
    n = max(1 << 20, min(params, 256 << 20))
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    times = time_step(copy, device, 3, max(iters, 5))
    return 2 * 4 * n / (statistics.median(times) * 1e-3) / 1e9


def free_memory(device: str) -> int:
    """Bytes free on ``device``: CUDA's free memory, or the host's available memory."""
    if device == "cuda":
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info()[0])
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def fits(device: str, need_bytes: float) -> str | None:
    """Why ``need_bytes`` do not fit on ``device`` (a sentence for the table), or None."""
    free = free_memory(device)
    if need_bytes > free:
        return f"needs about {need_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name from /proc/cpuinfo."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def default_threads() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# The CPU features that decide how fast bf16 runs on a CPU (AVX-512 BF16 dot products, AMX tiles).
CPU_FLAGS_OF_INTEREST = ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_flags() -> dict[str, bool]:
    """Which of :data:`CPU_FLAGS_OF_INTEREST` /proc/cpuinfo lists (all False elsewhere)."""
    listed: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                listed = set(line.split(":", 1)[1].split())
                break
    return {flag: flag in listed for flag in CPU_FLAGS_OF_INTEREST}


def format_cpu_flags(flags: dict[str, bool]) -> str:
    """``avx512_bf16 yes, amx_bf16 no, ...`` for a table's heading."""
    return ", ".join(f"{flag} {'yes' if on else 'no'}" for flag, on in flags.items())


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (a shared machine's other work), or ``n/a``."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"

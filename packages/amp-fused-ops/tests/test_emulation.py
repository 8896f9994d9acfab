"""The emulator of the CUDA kernels catches what a GPU punishes (csrc/emulation/selftest.cu).

Only under ``nox -s cuda_emulation`` (``AMP_FUSED_OPS_EMULATION`` set), where the kernels of
``selftest.cu`` are compiled into the emulated extension.
"""

from __future__ import annotations

import pytest
import torch

from _kernel_target import EMULATED, extension
from amp_fused_ops.emulation import Graph
from amp_fused_ops.emulation import _kernels as _emulation

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.cuda_emulation,
    pytest.mark.skipif(not EMULATED, reason="runs the emulated kernels (nox -s cuda_emulation)"),
]


@pytest.fixture(scope="module")
def selftest():
    extension()
    return torch.ops.amp_emu_selftest


def test_a_block_reduction_with_its_barriers_is_right(selftest):
    out = selftest.warp_sums(16, 256, True)
    assert out.tolist() == [sum(range(256))] * 16


def test_a_missing_barrier_gives_a_wrong_result(selftest):
    # Warps are scheduled in an order that changes per block: some block overwrites the
    # shared slots before thread 0 has summed them.
    out = selftest.warp_sums(16, 256, False)
    assert out.tolist() != [sum(range(256))] * 16


def test_a_barrier_not_reached_by_every_thread_raises(selftest):
    message = r"__syncthreads\(\) at .*selftest.* reached by 16 of 64 threads; 48 had exited"
    with pytest.raises(RuntimeError, match=message):
        selftest.early_exit()


def test_a_shuffle_whose_mask_names_an_exited_lane_raises(selftest):
    with pytest.raises(RuntimeError, match="mask 0xffffffff, which names lane 16 that has exited"):
        selftest.shuffle()


# --- shared memory: poisoned per block, reads before writes caught ----------------------------


def _counting_build() -> bool:
    return bool(torch.ops.amp_emu.counting())


def test_shared_memory_the_block_wrote_reads_back(selftest):
    out = selftest.shared_reads(64)
    assert out.tolist() == [float(t) for t in range(64)] * 2


def test_a_read_of_shared_memory_no_thread_wrote_is_caught(selftest):
    # Threads 48..63 read slots nobody wrote: zeros on the old emulator (the slots were
    # zero-initialized statics), garbage on a GPU.
    if not _counting_build():
        out = selftest.shared_reads(48)
        assert torch.isnan(out.view(2, 64)[:, 48:]).all()  # the poison, a NaN in every float
        return
    message = (
        r"amp_emu: shared_reads \(launched at selftest\.cu:\d+\) of type void\(float\*, int\), "
        r"block \(0, 0, 0\): thread \((4[89]|5\d|6[0-3]), 0, 0\) reads 4 byte\(s\) of "
        r"__shared__ memory .* that no thread of this block has written.*"
        r"\[schedule seed \d+; AMP_EMULATION_SEED=\d+ repeats"
    )
    with pytest.raises(RuntimeError, match=message):
        selftest.shared_reads(48)


def test_shared_memory_left_by_an_earlier_block_is_not_read(selftest):
    # Block 1 reads what block 0 wrote: the old emulator kept the value (statics outlive a
    # block); each block's shared memory is now poison until the block writes it.
    if not _counting_build():
        out = selftest.shared_from_previous_block()
        assert out[0].item() == 1.0
        assert torch.isnan(out[1])
        return
    with pytest.raises(RuntimeError, match=r"block \(1, 0, 0\): thread \(0, 0, 0\) reads 4 byte"):
        selftest.shared_from_previous_block()


# --- dynamic shared memory -------------------------------------------------------------------


def test_dynamic_shared_memory_the_block_wrote_reads_back(selftest):
    out = selftest.dynamic_shared(64, 64, 0, 64 * 4, -1)
    assert out.tolist() == [float(t) for t in range(64)] + [float(t + 1000) for t in range(64)]


def test_over_48_kib_of_dynamic_shared_memory_needs_the_kernels_attribute(selftest):
    big = 100 * 1024
    message = r"102400 bytes of dynamic shared memory, over the kernel's limit of 49152 \(over"
    with pytest.raises(RuntimeError, match=message):
        selftest.dynamic_shared(64, 64, 0, big, -1)
    out = selftest.dynamic_shared(64, 64, 0, big, big)
    assert out[64:].tolist() == [float(t + 1000) for t in range(64)]
    message = r"cudaFuncSetAttribute\(.*, 233472\): over the device's 232448 bytes of opt-in"
    with pytest.raises(RuntimeError, match=message):
        selftest.dynamic_shared(64, 64, 0, big, 228 * 1024)
    with (
        _emulation.shared_memory_per_block(99 * 1024),
        pytest.raises(RuntimeError, match="over the device's 101376 bytes"),
    ):
        selftest.dynamic_shared(64, 64, 0, big, big)
    selftest.dynamic_shared(64, 64, 0, big, big)  # the H100's limit back


def test_a_read_of_dynamic_shared_memory_no_thread_wrote_is_caught(selftest):
    # Each block's dynamic shared memory is poison until the block writes it, as the static.
    if not _counting_build():
        out = selftest.dynamic_shared(64, 48, 0, 64 * 4, -1)
        assert torch.isnan(out.view(2, 64)[:, 48:]).all()
        return
    message = (
        r"thread \((4[89]|5\d|6[0-3]), 0, 0\) reads 4 byte\(s\) of __shared__ memory \(offset "
        r"(19[2-9]|2[0-5]\d) of the dynamic shared memory\) that no thread of this block has "
        r"written"
    )
    with pytest.raises(RuntimeError, match=message):
        selftest.dynamic_shared(64, 48, 0, 64 * 4, -1)


def test_an_access_past_the_launchs_dynamic_shared_memory_is_caught(selftest):
    if not _counting_build():
        pytest.skip("the counting build checks the bounds (AddressSanitizer aborts the process)")
    message = r"thread \(63, 0, 0\) reads 4 byte\(s\) at offset 256 of dynamic shared memory, past"
    with pytest.raises(RuntimeError, match=message):
        selftest.dynamic_shared(64, 64, 1, 64 * 4, -1)


# --- lane order ------------------------------------------------------------------------------


@pytest.fixture
def seed():
    """Restores the schedule seed a test changes."""
    saved = torch.ops.amp_emu.schedule_seed()
    yield
    torch.ops.amp_emu.set_schedule_seed(saved)


def _lane_neighbours_expected(blocks: int) -> list[float]:
    # Lane i reads lane i - 1's slot, which holds (i - 1) + 1; lane 0 reads nothing.
    return [float(lane) for lane in range(32)] * blocks


def test_lanes_reading_a_neighbours_write_after_syncwarp_are_right(selftest):
    for shared in (False, True):
        out = selftest.lane_neighbours(16, True, shared)
        assert out.tolist() == _lane_neighbours_expected(16)


def test_lanes_reading_a_neighbours_global_write_without_syncwarp_give_a_wrong_result(selftest):
    # Lanes in index order (the old emulator, or lockstep) would all read the write; lanes
    # run in a shuffled order, so some read the slot before their neighbour has written it.
    out = selftest.lane_neighbours(16, False, False)
    assert out.tolist() != _lane_neighbours_expected(16)


def test_lanes_reading_a_neighbours_shared_write_without_syncwarp_are_caught(selftest):
    if not _counting_build():
        out = selftest.lane_neighbours(16, False, True)
        assert torch.isnan(out).any()
        return
    with pytest.raises(RuntimeError, match=r"lane_neighbours .*reads 4 byte\(s\) of __shared__"):
        selftest.lane_neighbours(16, False, True)


def test_the_schedule_seed_repeats_and_changes_the_lane_order(selftest, seed):
    outs = {}
    for value in (1, 2, 1):
        torch.ops.amp_emu.set_schedule_seed(value)
        assert torch.ops.amp_emu.schedule_seed() == value
        out = selftest.lane_neighbours(4, False, False)
        outs.setdefault(value, []).append(out)
    torch.testing.assert_close(outs[1][0], outs[1][1], rtol=0, atol=0)
    assert not torch.equal(outs[1][0], outs[2][0])


def test_a_negative_schedule_seed_raises(selftest, seed):
    with pytest.raises(RuntimeError, match=r"set_schedule_seed\(-1\): the seed is a non-negative"):
        torch.ops.amp_emu.set_schedule_seed(-1)


def test_a_misaligned_vector_access_raises(selftest):
    buffer = torch.arange(65, dtype=torch.float32)
    out = torch.zeros(65)
    selftest.vector_copy(buffer[:64], out[:64])
    assert torch.equal(out[:64], buffer[:64])
    message = r"misaligned access: address 0x[0-9a-f]+ of type .* needs alignment 16"
    with pytest.raises(RuntimeError, match=message):
        selftest.vector_copy(buffer[1:], out[:64])


@pytest.mark.parametrize(
    ("grid_x", "grid_y", "block_x", "block_z", "shared", "message"),
    [
        (0, 1, 32, 1, 0, "empty grid or block"),
        (2**31, 1, 32, 1, 0, "grid dimensions over CUDA's limits"),
        (1, 65536, 32, 1, 0, "grid dimensions over CUDA's limits"),
        (1, 1, 1025, 1, 0, "block over the H100's limits"),
        (1, 1, 1, 65, 0, "block over the H100's limits"),
        (1, 1, 32, 1, 48 * 1024 + 1, "bytes of dynamic shared memory"),
    ],
)
def test_launches_over_the_limits_raise(
    selftest, grid_x, grid_y, block_x, block_z, shared, message
):
    with pytest.raises(RuntimeError, match=message):
        selftest.launch(grid_x, grid_y, block_x, block_z, shared)
    selftest.launch(1, 1, 32, 1, 0)


def test_counters_count_launches_and_global_bytes(selftest):
    if not torch.ops.amp_emu.counting():
        pytest.skip("only the counting build counts bytes")
    x = torch.arange(1024, dtype=torch.float32)
    out = torch.zeros(1024)
    _emulation.reset_counters()
    selftest.vector_copy(x, out)
    counts = _emulation.counters()
    assert counts.launches == 1
    assert counts.blocks == 2  # 1024 floats, 4 per thread, 128 threads per block
    assert counts.bytes_read == counts.bytes_written == 4096
    assert counts.vector_bytes_read == counts.vector_bytes_written == 4096


def test_counters_count_the_store_after_a_load_of_the_same_address(selftest):
    # x[i] = x[i] * s: a store to the address that the same basic block has just loaded
    # (the compiler's AddressSanitizer pass left such stores unchecked, so none was counted).
    if not torch.ops.amp_emu.counting():
        pytest.skip("only the counting build counts bytes")
    x = torch.arange(1000, dtype=torch.float32)
    _emulation.reset_counters()
    selftest.scale_in_place(x, 2.0)
    counts = _emulation.counters()
    torch.testing.assert_close(x, 2 * torch.arange(1000, dtype=torch.float32), rtol=0, atol=0)
    assert counts.launches == 1
    assert counts.bytes_read == counts.bytes_written == 4000
    assert counts.vector_bytes_read == counts.vector_bytes_written == 0


# --- what the multi-tensor kernels read -------------------------------------------------------


def _counted(run) -> _emulation.Counters:
    extension()  # loads the emulated build, which defines torch.ops.amp_emu
    if not torch.ops.amp_emu.counting():
        pytest.skip("only the counting build counts bytes")
    _emulation.reset_counters()
    run()
    return _emulation.counters()


def test_a_launch_is_not_cut_by_its_block_count():
    # One tensor of 400 chunks: one launch of 400 blocks (the metadata names where each tensor's
    # blocks begin, not the chunk of every block, so the grid is not bounded by its size).
    x = torch.arange(400, dtype=torch.float32)
    out = torch.full((400,), float("nan"))
    flag = torch.zeros(1, dtype=torch.int32)
    counts = _counted(lambda: extension().multi_tensor_scale(1, flag, [[x], [out]], 0.5))
    torch.testing.assert_close(out, x * 0.5, rtol=0, atol=0)
    assert (counts.launches, counts.blocks) == (1, 400)


def test_count_launches_only_counts_as_a_full_run_and_runs_nothing():
    extension()  # the emulator's ops exist once a build is loaded
    xs = [torch.arange(n, dtype=torch.float32) for n in (5, 1, 40, 7)]
    outs = [torch.full_like(x, float("nan")) for x in xs]
    flag = torch.zeros(1, dtype=torch.int32)

    def step() -> None:
        extension().multi_tensor_scale(3, flag, [xs, outs], 0.5)
        extension().multi_tensor_l2norm(3, flag, [xs], True)

    with _emulation.count_launches_only():
        counted = _counted(step)
    assert all(out.isnan().all() for out in outs)  # nothing ran
    full = _counted(step)
    for x, out in zip(xs, outs, strict=True):
        torch.testing.assert_close(out, x * 0.5, rtol=0, atol=0)
    assert (counted.launches, counted.blocks) == (full.launches, full.blocks)
    assert counted.blocks > 0 and counted.bytes_read == counted.bytes_written == 0


def test_scale_reads_its_inputs_only():
    # 1000 fp16 in, 1000 fp32 out: the output is written, never read (vector part and tail).
    x = torch.linspace(-4, 4, 1000, dtype=torch.float16)
    out = torch.full((1000,), float("nan"))
    flag = torch.zeros(1, dtype=torch.int32)
    counts = _counted(lambda: extension().multi_tensor_scale(2048, flag, [[x], [out]], 0.5))
    torch.testing.assert_close(out, x.float() * 0.5, rtol=0, atol=0)
    assert (counts.bytes_read, counts.bytes_written) == (2000, 4000)


def test_axpby_reads_x_and_y_only():
    x, y = torch.linspace(-1, 1, 1001), torch.linspace(2, 3, 1001)
    out = torch.full((1001,), float("nan"))
    flag = torch.zeros(1, dtype=torch.int32)
    counts = _counted(
        lambda: extension().multi_tensor_axpby(2048, flag, [[x], [y], [out]], 2.0, -1.0, -1)
    )
    torch.testing.assert_close(out, 2.0 * x - y)
    assert (counts.bytes_read, counts.bytes_written) == (8008, 4004)


def test_master_adam_reads_no_half_params():
    # 5 lists: fp16 grads, fp16 params (only written, from the masters), fp32 m, v, masters.
    # Reads: the grads twice (the finiteness pass, then the step), m, v and the masters, plus
    # the device scalars every thread reads once per chunk (one chunk here, 512 threads): the
    # finiteness pass the noop flag and inv_scale (8 B), the step the noop flag, lr, inv_scale
    # and step (16 B).
    n = 4096
    grads = [torch.linspace(-1, 1, n, dtype=torch.float16)]
    params = [torch.full((n,), float("nan"), dtype=torch.float16)]
    masters = [torch.linspace(0, 1, n)]
    m, v = [torch.zeros(n)], [torch.zeros(n)]
    flag = torch.zeros(1, dtype=torch.int32)
    one = torch.ones(1)
    counts = _counted(
        lambda: extension().multi_tensor_adam_capturable_master(
            n,
            flag,
            [grads, params, m, v, masters],
            one * 1e-3,
            0.9,
            0.999,
            1e-8,
            one,
            1,
            1,
            0.0,
            one,
        )
    )
    torch.testing.assert_close(params[0], masters[0].half(), rtol=0, atol=0)
    assert counts.bytes_read == 2 * 2 * n + 3 * 4 * n + 512 * (8 + 16)
    assert counts.bytes_written == 2 * n + 3 * 4 * n


# --- what the norm kernels read and write -----------------------------------------------------


def _norm_minimum_bytes(
    rows: int, hidden: int, element: int, rms: bool, saves_output: bool = False
) -> int:
    """Five passes over the activations (forward: read x, write y; backward: read x, or y when
    the output is saved, and dy, write dx), the parameters read by each direction and their
    gradients written, and the float32 statistics written by the forward and read by the
    backward (from the output: the inverse deviation only)."""
    params = 1 if rms else 2
    written = 1 if rms else 2
    read = 1 if saves_output else written
    return 5 * rows * hidden * element + 3 * params * hidden * element + (written + read) * rows * 4


def _norm_step_bytes(
    dtype: torch.dtype, rms: bool, hidden: int, saves_output: bool
) -> tuple[float, int]:
    """A forward + backward of 248 rows on the resident kernels (the default), on a device
    scaled down to 2 SMs with the rows per SM of 16384 rows on an H100: the bytes moved over
    the minimum (``benchmarks/bench_norm_bytes.py``), and the launches."""
    extension()
    if not torch.ops.amp_emu.counting():
        pytest.skip("only the counting build counts bytes")
    ops = torch.ops.amp_fused_ops_emu
    rows = 248
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    dy = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    bias = None if rms else torch.randn(hidden, generator=gen).to(dtype)

    def step() -> None:
        y, mean, invvar = ops.norm_forward(x, weight, bias, 1e-5, rms, False, saves_output)
        saved = y if saves_output else x
        ops.norm_backward(dy, saved, mean, invvar, weight, bias, rms, saves_output, dtype)

    with _emulation.multiprocessors(2):
        counts = _counted(step)
    moved = counts.bytes_read + counts.bytes_written
    minimum = _norm_minimum_bytes(rows, hidden, x.element_size(), rms, saves_output)
    return moved / minimum, counts.launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("hidden", [1024, 4096, 16384])
def test_a_norm_step_moves_at_most_1_1_times_the_minimum_bytes(monkeypatch, dtype, rms, hidden):
    """The resident kernels read each row of x and dy once and sum the parameter gradients in
    the input-gradient pass (in registers, or at 16384 in shared memory): a forward + backward
    moves at most 1.1x the minimum, in 3 launches (forward, backward, the parameter gradients'
    last sum). The earlier per-row kernels move 3-4x."""
    monkeypatch.delenv("AMP_FUSED_OPS_NORM_KERNELS", raising=False)
    ratio, launches = _norm_step_bytes(dtype, rms, hidden, saves_output=False)
    assert ratio <= 1.1, f"{ratio:.3f}x the minimum"
    assert launches == 3


@pytest.mark.parametrize(
    ("rms", "launches_99k"), [(False, 4), (True, 3)], ids=["layer_norm", "rms_norm"]
)
def test_wide_rows_sum_their_parameter_gradients_in_shared_memory_where_it_fits(
    monkeypatch, rms, launches_99k
):
    """At 16384 float32 the backward keeps a float32 sum per column and parameter in shared
    memory: 128 KiB for a LayerNorm, 64 KiB for an RMSNorm. An H100 offers 227 KiB per block;
    a GPU offering 99 KiB (RTX-class) takes the RMSNorm's and leaves the LayerNorm's to the
    column kernel (one launch more). Same gradients either way, up to the order of the sums."""
    monkeypatch.delenv("AMP_FUSED_OPS_NORM_KERNELS", raising=False)
    extension()
    ops = torch.ops.amp_fused_ops_emu
    rows, hidden = 12, 16384
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, hidden, generator=gen)
    dy = torch.randn(rows, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5
    bias = None if rms else torch.randn(hidden, generator=gen)

    def backward() -> tuple[tuple[torch.Tensor, ...], int]:
        _, mean, invvar = ops.norm_forward(x, weight, bias, 1e-5, rms, False, False)
        _emulation.reset_counters()
        grads = ops.norm_backward(dy, x, mean, invvar, weight, bias, rms, False, torch.float32)
        return grads, _emulation.counters().launches

    with _emulation.multiprocessors(2):
        h100, h100_launches = backward()
        with _emulation.shared_memory_per_block(99 * 1024):
            small, small_launches = backward()
        # AMP_FUSED_OPS_NORM_KERNELS=resident_column: the column kernel wherever it fits too.
        monkeypatch.setenv("AMP_FUSED_OPS_NORM_KERNELS", "resident_column")
        column, column_launches = backward()
    assert (h100_launches, small_launches, column_launches) == (2, launches_99k - 1, 3)
    for other in (small, column):
        torch.testing.assert_close(other[0], h100[0], rtol=0, atol=0)  # dx: the same kernel
        for a, b in zip(other[1:], h100[1:], strict=True):
            if b.numel():
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("hidden", [1024, 16384])
def test_a_memory_efficient_norm_step_moves_at_most_1_1_times_the_minimum_bytes(
    monkeypatch, dtype, rms, hidden
):
    """With ``memory_efficient`` the backward recomputes xhat from the saved output and the
    bias; rows over 8192 of a half output keep the bias in shared memory beside the gradient
    sums, so the backward still reads each row once (the per-row kernels it took before moved
    3.0-3.6x the minimum at 16384)."""
    monkeypatch.delenv("AMP_FUSED_OPS_NORM_KERNELS", raising=False)
    ratio, launches = _norm_step_bytes(dtype, rms, hidden, saves_output=True)
    assert ratio <= 1.1, f"{ratio:.3f}x the minimum"
    assert launches == 3


def test_memory_efficient_wide_rows_keep_the_bias_in_shared_memory_where_it_fits(monkeypatch):
    """A memory-efficient LayerNorm backward of 16384 bfloat16 keeps the bias beside the
    gradient sums in shared memory (192 KiB): 2 launches on an H100. On 99 KiB per block the
    bias fits, the sums do not (the column kernel: 3); on 48 KiB not even the bias (the per-row
    kernels: 3). float32 rows that wide take the per-row kernels (their registers would spill).
    The same gradients, up to the order of the sums."""
    monkeypatch.delenv("AMP_FUSED_OPS_NORM_KERNELS", raising=False)
    extension()
    ops = torch.ops.amp_fused_ops_emu
    rows, hidden = 12, 16384
    gen = torch.Generator().manual_seed(11)
    weight = torch.rand(hidden, generator=gen) + 0.5
    bias = torch.randn(hidden, generator=gen)
    dy = torch.randn(rows, hidden, generator=gen)
    x = torch.randn(rows, hidden, generator=gen)

    def backward(dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], int]:
        w, b, g = weight.to(dtype), bias.to(dtype), dy.to(dtype)
        y, mean, invvar = ops.norm_forward(x.to(dtype), w, b, 1e-5, False, False, True)
        _emulation.reset_counters()
        grads = ops.norm_backward(g, y, mean, invvar, w, b, False, True, dtype)
        return grads, _emulation.counters().launches

    with _emulation.multiprocessors(2):
        h100, h100_launches = backward(torch.bfloat16)
        with _emulation.shared_memory_per_block(99 * 1024):
            small, small_launches = backward(torch.bfloat16)
        with _emulation.shared_memory_per_block(48 * 1024):
            per_row, per_row_launches = backward(torch.bfloat16)
        _, float32_launches = backward(torch.float32)
        monkeypatch.setenv("AMP_FUSED_OPS_NORM_KERNELS", "per_row")
        _, float32_per_row_launches = backward(torch.float32)
    assert (h100_launches, small_launches, per_row_launches) == (2, 3, 3)
    assert float32_launches == float32_per_row_launches == 3
    torch.testing.assert_close(small[0], h100[0], rtol=0, atol=0)  # dx: the same kernel
    torch.testing.assert_close(per_row[0], h100[0], rtol=1e-2, atol=1e-2)
    for other in (small, per_row):
        for a, b in zip(other[1:], h100[1:], strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_the_norm_grid_follows_the_emulated_sm_count(monkeypatch):
    """A forward of 248 rows of 1024 float32: 64 threads per row, 4 rows per block, at most
    8 blocks of 256 threads per SM, so 8 blocks on one SM and one per row group (62) on the
    H100's 132, the count restored after the block."""
    monkeypatch.delenv("AMP_FUSED_OPS_NORM_KERNELS", raising=False)
    x = torch.randn(248, 1024)

    def forward() -> None:
        torch.ops.amp_fused_ops_emu.norm_forward(x, None, None, 1e-5, False, False, False)

    with _emulation.multiprocessors(1):
        one_sm = _counted(forward)
    h100 = _counted(forward)
    assert (one_sm.launches, one_sm.blocks) == (1, 8)
    assert (h100.launches, h100.blocks) == (1, 62)
    with (
        pytest.raises(RuntimeError, match=r"set_multiprocessor_count\(0\): the count is an"),
        _emulation.multiprocessors(0),
    ):
        pass


# --- capture and replay ----------------------------------------------------------------------


def test_a_graph_holds_the_tensors_of_its_capture_until_reset():
    # The launcher's outputs and scratch tensors are made during the capture; the recorded
    # launches write them on replay, so the graph keeps them (as a CUDA graph's memory pool).
    import gc
    import weakref

    ext = extension()
    x = [torch.full((1000,), 2.0)]
    flag = torch.zeros(1, dtype=torch.int32)
    graph = Graph()
    with graph:
        total, _ = ext.multi_tensor_l2norm(256, flag, [x], False)
    held = weakref.ref(total)
    del total
    gc.collect()
    assert held() is not None
    x[0].fill_(3.0)
    graph.replay()
    torch.testing.assert_close(held(), torch.tensor([3.0 * 1000**0.5]))
    graph.reset()
    gc.collect()
    assert held() is None


def test_a_graph_replays_the_aten_ops_of_its_capture():
    # An int step is copied to float32 by the launcher (an ATen op): replay copies the
    # current value again, as a CUDA graph replays the copy kernel.
    ext = extension()
    n = 64

    def run(graph_steps: list[int] | None) -> torch.Tensor:
        grads = [torch.linspace(-1, 1, n)]
        masters = [torch.linspace(0, 1, n)]
        lists = [grads, [torch.zeros(n)], [torch.zeros(n)], [torch.zeros(n)], masters]
        step = torch.ones(1, dtype=torch.int64)
        args = (torch.full((1,), 0.1), 0.9, 0.999, 1e-8, step, 1, 1, 0.0, torch.ones(1))
        flag = torch.zeros(1, dtype=torch.int32)
        if graph_steps is None:  # eager, steps 1 then 2
            for value in (1, 2):
                step.fill_(value)
                ext.multi_tensor_adam_capturable_master(n, flag, lists, *args)
            return masters[0]
        graph = Graph()
        with graph:
            ext.multi_tensor_adam_capturable_master(n, flag, lists, *args)
        for value in graph_steps:
            step.fill_(value)
            graph.replay()
        return masters[0]

    torch.testing.assert_close(run([1, 2]), run(None), rtol=0, atol=0)


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.item(),
        lambda t: bool(t),
        lambda t: float(t),
        lambda t: t.tolist(),  # no ATen op: caught by the capture's function mode
        lambda t: t.numpy(),
    ],
    ids=["item", "bool", "float", "tolist", "numpy"],
)
def test_a_host_sync_inside_a_capture_raises(read):
    extension()  # the emulator's capture ops
    graph = Graph()
    with pytest.raises(RuntimeError, match="host synchronization"), graph:
        read(torch.ones(1).add(1))

"""The emulator of the CUDA kernels catches what a GPU punishes (csrc/emulation/selftest.cu).

Only under ``nox -s cuda_emulation`` (``AMP_FUSED_OPS_EMULATION`` set), where the kernels of
``selftest.cu`` are compiled into the emulated extension.
"""

from __future__ import annotations

import pytest
import torch

from _kernel_target import EMULATED, extension
from amp_fused_ops import _emulation

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

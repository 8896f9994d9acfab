"""The emulator build's rewrite of ``kernel<<<config>>>(args)`` launches (no compile needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from amp_fused_ops.emulation import _kernels as _emulation


@pytest.mark.parametrize(
    ("source", "name", "line"),
    [
        ("  plain_kernel<<<1, 32>>>(x);", "plain_kernel", 1),
        ("  k<float, 4><<<blocks, 256, 0, stream>>>(x);", "k<float, 4>", 1),
        # The line is the one of the launch configuration.
        (
            "  ns::k<Op<Ts...>, P<T, 4>>\n      <<<blocks, 128>>>(x);",
            "ns::k<Op<Ts...>, P<T, 4>>",
            2,
        ),
    ],
)
def test_a_launch_is_named_after_its_kernel_expression(source, name, line):
    out = _emulation._rewrite(source, "file.cu")
    assert f'.named("{name}", "file.cu", {line})' in out
    assert "<<<" not in out


def test_the_rewrite_keeps_the_line_of_every_launch():
    source = "a;\nk<<<grid,\n    block>>>(x);\nb;\nother<<<1, 1>>>();\n"
    out = _emulation._rewrite(source, "f.cu")
    assert out.count("\n") == source.count("\n")
    assert '.named("k", "f.cu", 2)' in out
    assert '.named("other", "f.cu", 5)' in out
    assert out.splitlines()[4].startswith("other % ::amp_emu::LaunchConfig(1, 1)")


@pytest.mark.parametrize(
    ("source", "pointer"),
    [
        (
            "extern __shared__ float sums[];",
            "float* const sums = ::amp_emu::dynamic_shared<float>();",
        ),
        (
            "  extern __shared__ alignas(16) unsigned char raw [ ];",
            "  unsigned char* const raw",
        ),
        (
            "extern __shared__ ns::Pack buf[];",
            "ns::Pack* const buf = ::amp_emu::dynamic_shared<ns::Pack>();",
        ),
    ],
)
def test_dynamic_shared_memory_becomes_the_emulators_buffer(source, pointer):
    out = _emulation._rewrite(source, "f.cu")
    assert "extern" not in out
    assert pointer in out


def test_static_shared_memory_is_left_alone():
    source = "__shared__ float staged[32];\nextern float global_thing[];\n"
    assert _emulation._rewrite(source, "f.cu") == source


def test_the_emulators_controls_say_when_no_build_is_loaded():
    # A fresh process: nothing has loaded an emulated build, so torch.ops.amp_emu is empty.
    code = (
        "from amp_fused_ops import emulation\n"
        "for call in (emulation.counters, lambda: emulation.multiprocessors(2).__enter__()):\n"
        "    try:\n"
        "        call()\n"
        "    except RuntimeError as error:\n"
        "        print(error)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.splitlines()
    assert (
        out
        == [
            "no emulated build of the CUDA kernels is loaded in this process: call "
            "amp_fused_ops.emulation.load() first"
        ]
        * 2
    )

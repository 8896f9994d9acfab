"""The compiled modules load where torch's wheels load: glibc 2.28 and GCC 8's C++ runtime.

``csrc/common/libstdcxx_compat.cpp`` defines, inside each module, the few runtime symbols that
the headers of a recent GCC and glibc reference but older systems lack. These check that a
module built here requires no symbol version newer than the manylinux_2_28 platform allows,
and that the replacements behave as the runtime's own, under AddressSanitizer.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
COMPAT = CSRC / "common" / "libstdcxx_compat.cpp"

# The newest version of each runtime that the manylinux_2_28 platform (PEP 600; torch's own
# wheels) guarantees on x86-64: glibc 2.28 and the C++ runtime of GCC 8.
MANYLINUX_2_28 = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11), "GCC": (7, 0, 0)}

pytestmark = pytest.mark.skipif(
    not (
        sys.platform.startswith("linux")
        and platform.machine() == "x86_64"
        and platform.libc_ver()[0] == "glibc"
    ),
    reason="the definitions apply to Linux x86-64 with glibc",
)


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; the compiled modules need binutils and g++")
    return found


def required_versions(library: Path) -> dict[str, list[tuple[int, ...]]]:
    """The symbol versions ``library`` requires, by runtime (``GLIBC``, ``GLIBCXX``, ...)."""
    listing = subprocess.run(
        [_tool("objdump"), "-p", str(library)], capture_output=True, text=True, check=True
    ).stdout
    _, _, references = listing.partition("Version References:")
    found: dict[str, list[tuple[int, ...]]] = {}
    for name, number in re.findall(
        r"\s0x[0-9a-f]+ 0x[0-9a-f]+ \d+ ([A-Z]+)_([0-9.]+)\n", references
    ):
        found.setdefault(name, []).append(tuple(int(part) for part in number.split(".")))
    return found


def newer_than_manylinux_2_28(library: Path) -> list[str]:
    versions = required_versions(library)
    assert "GLIBC" in versions, f"no version references read from {library}"
    return sorted(
        f"{name}_{'.'.join(map(str, number))}"
        for name, numbers in versions.items()
        for number in numbers
        if name in MANYLINUX_2_28 and number > MANYLINUX_2_28[name]
    )


def test_cpu_module_requires_nothing_newer_than_manylinux_2_28(cpu_extension: object) -> None:
    library = Path(str(getattr(cpu_extension, "__file__", "")))
    assert library.is_file()
    assert newer_than_manylinux_2_28(library) == []


# Each line exercises one definition of libstdcxx_compat.cpp through the standard library, as the
# headers of torch and of the kernels do: std::exception_ptr (at::parallel_for hands a worker's
# exception to the calling thread through one), std::ostringstream (every error message),
# std::pow, std::allocator's size check and shared_ptr's reference counts.
_CHECKS = r"""
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

static int destroyed = 0;
struct Counted : std::runtime_error {
  Counted() : std::runtime_error("counted") {}
  ~Counted() override { ++destroyed; }
};

#define CHECK(condition) \
  if (!(condition)) { std::printf("failed line %d: %s\n", __LINE__, #condition); return 1; }

extern "C" int run_checks() {
  std::ostringstream message;
  message << "step " << 7 << " of " << 2.5;
  CHECK(message.str() == "step 7 of 2.5");
#if __cplusplus > 201703L
  std::stringbuf buffer;
  buffer.sputn("moved", 5);
  CHECK(std::move(buffer).str() == "moved");
#endif
  volatile double half = 0.5;
  CHECK(std::pow(2.0, 10.0) == 1024.0 && std::pow(9.0, static_cast<double>(half)) == 3.0);
  CHECK(std::isnan(std::pow(-8.0, static_cast<double>(half))));
  {
    std::exception_ptr first;
    try { throw Counted(); } catch (...) { first = std::current_exception(); }
    std::exception_ptr second = first;   // a reference more
    std::exception_ptr third(second);
    first = nullptr;                     // two less: the object lives on
    second = nullptr;
    CHECK(destroyed == 0);
    try { std::rethrow_exception(third); } catch (const Counted& error) {
      CHECK(std::string(error.what()) == "counted");
    }
    CHECK(destroyed == 0);
  }
  CHECK(destroyed == 1);                  // freed once, with the last reference
  {
    std::exception_ptr from_worker;
    std::thread worker([&] {
      try { throw Counted(); } catch (...) { from_worker = std::current_exception(); }
    });
    worker.join();
    std::exception_ptr kept = from_worker;
    from_worker = nullptr;
    CHECK(kept && destroyed == 1);
  }
  CHECK(destroyed == 2);
  bool refused = false;
  try {
    std::allocator<double> allocator;
    (void)allocator.allocate(static_cast<std::size_t>(-1) / 4);
  } catch (const std::bad_array_new_length&) {
    refused = true;
  }
  CHECK(refused);
  auto shared = std::make_shared<std::vector<int>>(3, 1);
  std::vector<std::thread> copiers;
  for (int t = 0; t < 4; ++t) {
    copiers.emplace_back([shared] { for (int i = 0; i < 10000; ++i) { auto copy = shared; } });
  }
  for (auto& copier : copiers) copier.join();
  CHECK(shared.use_count() == 1);
  std::printf("ok\n");
  return 0;
}
"""


@pytest.mark.parametrize("standard", ["c++17", "c++20"])
def test_definitions_behave_as_the_runtime(tmp_path: Path, standard: str) -> None:
    compiler = _tool("g++")
    (tmp_path / "checks.cpp").write_text(_CHECKS)
    (tmp_path / "main.cpp").write_text(
        'extern "C" int run_checks();\nint main() { return run_checks(); }\n'
    )
    flags = [f"-std={standard}", "-O1", "-g", "-fPIC", "-pthread", "-Wall", "-Werror"]
    sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    # The checks as a shared library with the definitions, as in a module.
    library = tmp_path / "libchecks.so"
    subprocess.run(
        [
            compiler,
            *flags,
            "-shared",
            str(tmp_path / "checks.cpp"),
            str(COMPAT),
            "-o",
            str(library),
        ],
        check=True,
    )
    assert newer_than_manylinux_2_28(library) == []
    exported = subprocess.run(
        [_tool("nm"), "-D", "--defined-only", str(library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # Hidden: a visible definition would take over the runtime's own calls to these names.
    assert not {line.split()[-1] for line in exported.splitlines() if line.strip()} & {
        "_ZNSt15__exception_ptr13exception_ptr9_M_addrefEv",
        "_ZNSt15__exception_ptr13exception_ptr10_M_releaseEv",
        "_ZSt28__throw_bad_array_new_lengthv",
        "__libc_single_threaded",
        "pow",
    }
    # The same checks as a program under the sanitizers: the runtime's results, nothing leaked.
    program = tmp_path / "checks"
    subprocess.run(
        [compiler, *flags, *sanitize, str(tmp_path / "checks.cpp"), str(tmp_path / "main.cpp"),
         str(COMPAT), "-o", str(program)],
        check=True,
    )  # fmt: skip
    result = subprocess.run(
        [str(program)],
        capture_output=True,
        text=True,
        env={"ASAN_OPTIONS": "detect_leaks=1", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert (result.returncode, result.stdout) == (0, "ok\n"), result.stdout + result.stderr

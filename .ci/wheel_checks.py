"""Checks of the built wheels and sdists (`nox -s build`, `nox -s wheel_prebuilt`).

Usage::

    python .ci/wheel_checks.py imports <import name> <virtualenv>
    python .ci/wheel_checks.py license <wheel> <sdist> <LICENSE>
    python .ci/wheel_checks.py metadata <wheel>...
    python .ci/wheel_checks.py first-use <virtualenv>
    python .ci/wheel_checks.py no-python-api <wheel>
    python .ci/wheel_checks.py cuda-module <virtualenv>

``imports``: the package imports from the wheel installed in the virtualenv (not from a
checkout). ``license``: the wheel and the sdist ship the LICENSE file and the metadata declares
``License-Expression: BSD-3-Clause``. ``metadata``: no wheel requires a CUDA build of torch or
an NVIDIA package (a CPU-only machine must be able to install it next to a CPU torch).
``first-use``: run in a virtualenv that has an amp-fused-ops wheel with prebuilt kernels, with
``AMP_FUSED_OPS_CACHE`` pointing at an empty folder: the first ``amp_C`` ops (a scale and an
Adam step) run on the kernels shipped in the wheel, nothing is compiled and nothing is written
to the cache.
``no-python-api``: no shared library in the wheel uses Python's C API (no undefined ``Py*`` or
``_Py*`` symbol, no ``libpython`` needed), so one wheel tagged ``py3-none`` serves every Python;
read with binutils' ``nm`` and ``readelf``. ``cuda-module``: run in a virtualenv with a CUDA build
of torch and an amp-fused-ops wheel that ships a CUDA module for it, with ``AMP_FUSED_OPS_CACHE``
pointing at an empty folder: that module loads (no GPU needed) and registers its ops, and nothing
is compiled.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

# A requirement on an NVIDIA package (nvidia-*, cuda-*) or on a CUDA build of torch (+cu...).
_CUDA_REQUIREMENT = re.compile(r"^(nvidia-|cuda-|torch\b.*\+cu\d)", re.IGNORECASE)


def check_imports(name: str, venv: pathlib.Path) -> int:
    module = importlib.import_module(name)
    where = pathlib.Path(str(module.__file__)).resolve()
    if not where.is_relative_to(venv.resolve()):
        print(f"{name} was imported from {where}, not from the wheel in {venv}", file=sys.stderr)
        return 1
    print(f"{name} {module.__version__} imports from its wheel")
    return 0


def _wheel_metadata(wheel: pathlib.Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


def check_license(wheel: pathlib.Path, sdist: pathlib.Path, expected: pathlib.Path) -> int:
    text = expected.read_text()
    with zipfile.ZipFile(wheel) as z:
        licenses = [n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        if not licenses or z.read(licenses[0]).decode() != text:
            print(f"{wheel.name} does not ship the LICENSE file", file=sys.stderr)
            return 1
    if "License-Expression: BSD-3-Clause" not in _wheel_metadata(wheel).splitlines():
        print(
            f"{wheel.name} metadata declares no License-Expression: BSD-3-Clause", file=sys.stderr
        )
        return 1
    with tarfile.open(sdist) as t:
        member = next(
            (m for m in t.getmembers() if m.name.count("/") == 1 and m.name.endswith("/LICENSE")),
            None,
        )
        extracted = t.extractfile(member) if member is not None else None
        if extracted is None or extracted.read().decode() != text:
            print(f"{sdist.name} does not ship the LICENSE file", file=sys.stderr)
            return 1
    print(f"{wheel.name} and {sdist.name} ship the BSD-3-Clause LICENSE")
    return 0


def check_metadata(wheels: list[pathlib.Path]) -> int:
    failed = 0
    for wheel in wheels:
        requires = [
            line.removeprefix("Requires-Dist:").strip()
            for line in _wheel_metadata(wheel).splitlines()
            if line.startswith("Requires-Dist:")
        ]
        cuda = [r for r in requires if _CUDA_REQUIREMENT.match(r)]
        if cuda:
            print(f"{wheel.name} requires a CUDA build or NVIDIA packages: {cuda}", file=sys.stderr)
            failed = 1
        else:
            print(f"{wheel.name} requires: {', '.join(requires)} (no CUDA build forced)")
    return failed


def _empty_cache() -> pathlib.Path | None:
    """``AMP_FUSED_OPS_CACHE``, which must name an existing empty folder (else ``None``)."""
    cache = os.environ.get("AMP_FUSED_OPS_CACHE", "")
    if not cache or not pathlib.Path(cache).is_dir() or any(pathlib.Path(cache).iterdir()):
        print(f"AMP_FUSED_OPS_CACHE={cache!r} must name an existing empty folder", file=sys.stderr)
        return None
    return pathlib.Path(cache)


def _uses_prebuilt(kind: str) -> bool:
    """Whether the loader will take the wheel's module of ``kind`` (loads nothing)."""
    import torch

    from amp_fused_ops import extensions

    status = extensions.extension_status(kind)
    print(f"{kind} extension under torch {torch.__version__}: {status.state} ({status.detail})")
    if status.state != "prebuilt":
        print(f"the wheel's prebuilt {kind} module is not used", file=sys.stderr)
        return False
    return True


def _from_wheel(module: object, venv: pathlib.Path, cache: pathlib.Path) -> pathlib.Path | None:
    """The file of ``module`` if it is a module of the wheel in ``venv`` and nothing was written
    to ``cache``; else ``None``, with the reason printed."""
    where = pathlib.Path(str(getattr(module, "__file__", ""))).resolve()
    if module is None or not where.is_relative_to(venv.resolve()) or "_prebuilt" not in where.parts:
        print(f"the module loaded is not the wheel's: {where}", file=sys.stderr)
        return None
    written = sorted(str(p) for p in cache.rglob("*"))
    if written:
        print(f"the cache was written to: {written}", file=sys.stderr)
        return None
    return where


def check_first_use(venv: pathlib.Path) -> int:
    cache = _empty_cache()
    # A prebuilt module is loaded as is; below, a compile would show as a module outside the
    # wheel and as files written to the (empty) cache.
    if cache is None or not _uses_prebuilt("cpu"):
        return 1
    import torch

    from amp_fused_ops import amp_C, extensions, multi_tensor_applier

    start = time.perf_counter()
    flag = torch.zeros(1, dtype=torch.int)
    inputs = [torch.arange(1.0, 6.0), torch.full((3,), -2.0)]  # one dtype per list
    outputs = [torch.empty_like(t, dtype=torch.bfloat16) for t in inputs]
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [inputs, outputs], 0.5)
    for x, out in zip(inputs, outputs, strict=True):
        torch.testing.assert_close(out, (x * 0.5).to(torch.bfloat16))
    # One Adam step (what FusedAdam.step() launches), against the plain formula in float32.
    p, g = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 0.25, -1.0])
    m, v = torch.zeros(3), torch.zeros(3)
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    expected = p - lr * ((1 - b1) * g / (1 - b1)) / (((1 - b2) * g * g / (1 - b2)).sqrt() + eps)
    params = [p.clone()]
    multi_tensor_applier(
        amp_C.multi_tensor_adam, flag, [[g], params, [m], [v]], lr, b1, b2, eps, 1, 1, 1, 0.0
    )
    torch.testing.assert_close(params[0], expected)
    elapsed = time.perf_counter() - start

    where = _from_wheel(extensions.get_extension("cpu"), venv, cache)
    if where is None:
        return 1
    print(f"first amp_C ops ran on the prebuilt kernels {where} in {elapsed:.2f} s, no compile")
    return 0


# A symbol of Python's C API or of its internals (PyLong_FromLong, _Py_Dealloc, Py_None...).
_PYTHON_SYMBOL = re.compile(r"^_?Py")


def python_api_uses(library: pathlib.Path) -> list[str]:
    """What ``library`` takes from Python: its undefined ``Py*``/``_Py*`` symbols and the
    ``libpython`` it needs."""
    for tool in ("nm", "readelf"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} (binutils) not found: cannot read {library.name}")
    symbols = subprocess.run(
        ["nm", "-D", "--undefined-only", "--format=posix", str(library)],
        capture_output=True, text=True, check=True,
    ).stdout.split("\n")  # fmt: skip
    uses = sorted({line.split()[0] for line in symbols if _PYTHON_SYMBOL.match(line)})
    dynamic = subprocess.run(
        ["readelf", "-d", "-W", str(library)], capture_output=True, text=True, check=True
    ).stdout
    uses += re.findall(r"\(NEEDED\)\s+Shared library: \[(libpython[^]]*)\]", dynamic)
    return uses


def check_no_python_api(wheel: pathlib.Path) -> int:
    with zipfile.ZipFile(wheel) as archive, tempfile.TemporaryDirectory() as tmp:
        names = [n for n in archive.namelist() if re.search(r"\.so(\.|$)", n)]
        if not names:
            print(f"{wheel.name} has no shared library to check", file=sys.stderr)
            return 1
        failed = 0
        for name in names:
            uses = python_api_uses(pathlib.Path(archive.extract(name, tmp)))
            if uses:
                failed = 1
                shown = ", ".join(uses[:8]) + (" ..." if len(uses) > 8 else "")
                print(f"{name} uses Python's C API ({len(uses)}): {shown}", file=sys.stderr)
    if not failed:
        print(f"{wheel.name}: {len(names)} shared libraries, none uses Python's C API")
    return failed


def check_cuda_module(venv: pathlib.Path) -> int:
    cache = _empty_cache()
    if cache is None or not _uses_prebuilt("cuda"):
        return 1
    from amp_fused_ops import extensions

    module = extensions.get_extension("cuda")
    if module is None:
        print(f"it did not load: {extensions.unavailable_reason('cuda')}", file=sys.stderr)
        return 1
    where = _from_wheel(module, venv, cache)
    if where is None:
        return 1
    ops = sorted(name for name in dir(module) if name.startswith("multi_tensor_"))
    if not ops:
        print(f"{where.name} registered no multi_tensor_ op", file=sys.stderr)
        return 1
    print(f"loaded the wheel's {where.name} with {len(ops)} ops: {', '.join(ops)}")
    return 0


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    paths = [pathlib.Path(a) for a in args]
    if command == "imports":
        return check_imports(args[0], paths[1])
    if command == "license":
        return check_license(*paths)
    if command == "metadata":
        return check_metadata(paths)
    if command == "first-use":
        return check_first_use(paths[0])
    if command == "no-python-api":
        return check_no_python_api(paths[0])
    if command == "cuda-module":
        return check_cuda_module(paths[0])
    print(
        f"unknown check {command!r}: expected imports, license, metadata, first-use, "
        "no-python-api or cuda-module"
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

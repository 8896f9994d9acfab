"""The check behind the prebuilt wheel's ``py3-none`` tag finds a module that uses Python.

``nox -s wheel_prebuilt`` runs ``.ci/wheel_checks.py no-python-api`` on the wheel it builds: one
wheel serves every Python only while no shared library in it takes a symbol of Python's C API.
Here the check reads two small libraries compiled on the spot, one that calls ``PyLong_AsLong``
and one that does not, alone and packed into a wheel.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("gcc", "nm", "readelf")),
    reason="needs gcc and binutils (nm, readelf)",
)


def _wheel_checks():
    spec = importlib.util.spec_from_file_location("wheel_checks", ROOT / ".ci" / "wheel_checks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _library(tmp_path: Path, name: str, source: str) -> Path:
    (tmp_path / f"{name}.c").write_text(source)
    library = tmp_path / f"lib{name}.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-o", str(library), str(tmp_path / f"{name}.c")], check=True
    )
    return library


USES_PYTHON = "long PyLong_AsLong(void *);\nlong value(void *o) { return PyLong_AsLong(o); }\n"
PLAIN = "#include <math.h>\ndouble root(double x) { return sqrt(x); }\n"


def test_names_the_python_symbols_a_library_takes(tmp_path):
    checks = _wheel_checks()
    assert checks.python_api_uses(_library(tmp_path, "uses", USES_PYTHON)) == ["PyLong_AsLong"]
    assert checks.python_api_uses(_library(tmp_path, "plain", PLAIN)) == []


@pytest.mark.parametrize(("source", "expected"), [(USES_PYTHON, 1), (PLAIN, 0)])
def test_wheel_check_fails_on_a_module_that_uses_python(tmp_path, capsys, source, expected):
    library = _library(tmp_path, "module", source)
    wheel = tmp_path / "demo-0.1-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(library, "demo/_prebuilt/module.so")
    assert _wheel_checks().check_no_python_api(wheel) == expected
    output = capsys.readouterr()
    if expected:
        assert "demo/_prebuilt/module.so uses Python's C API (1): PyLong_AsLong" in output.err
    else:
        assert "1 shared libraries, none uses Python's C API" in output.out


def test_wheel_check_fails_on_a_wheel_without_libraries(tmp_path, capsys):
    wheel = tmp_path / "demo-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("demo/__init__.py", "")
    assert _wheel_checks().check_no_python_api(wheel) == 1
    assert "has no shared library to check" in capsys.readouterr().err

"""Every routine task of the amp toolkit is a nox session; `nox --list` shows them.

Sessions reuse the torch that is already installed (virtualenvs with system site packages),
so nothing large is downloaded when torch is present. Our own packages are always installed
from this checkout (editable, without dependencies), never from an index.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PACKAGES = ["amp-core", "amp-fused-ops", "amp-optimizers", "amp-parallel", "amp-legacy-fp16"]
IMPORT_NAMES = {package: package.replace("-", "_") for package in PACKAGES}
SRC_DIRS = [f"packages/{package}/src" for package in PACKAGES]
TORCH_REQUIREMENT = "torch>=2.11,<2.15"
SYSTEM_SITE = ["--system-site-packages"]
CUDA_SOURCE_DIR = ROOT / "packages" / "amp-fused-ops" / "csrc" / "cuda"

nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True

# Fails unless every amp_* module resolves to this checkout's packages/ folder, so that a
# sibling package pulled from an index (or installed elsewhere) cannot stand in for ours.
# find_spec locates a module without importing it.
_CHECKOUT_GUARD = """
import importlib.util, pathlib, sys
root = pathlib.Path(sys.argv[1]).resolve()
bad = []
for name in sys.argv[2:]:
    spec = importlib.util.find_spec(name)
    origin = pathlib.Path(spec.origin).resolve() if spec and spec.origin else None
    if origin is None or not origin.is_relative_to(root):
        bad.append(f"{name} -> {origin}")
if bad:
    sys.exit(f"these modules do not come from {root}: " + ", ".join(bad))
print(f"checkout guard: all amp_* modules come from {root}")
"""

# Imports one package in a fresh virtualenv and checks it came from the wheel installed there.
_WHEEL_IMPORT_CHECK = """
import importlib, pathlib, sys
name, venv = sys.argv[1], pathlib.Path(sys.argv[2]).resolve()
module = importlib.import_module(name)
where = pathlib.Path(module.__file__).resolve()
if not where.is_relative_to(venv):
    sys.exit(f"{name} was imported from {where}, not from the wheel installed in {venv}")
print(f"{name} {module.__version__} imports from its wheel")
"""

# Loads the CUDA extension the `build cuda` command just compiled (from the same cache, no
# second compile) and checks it has its ops: proves the module links and imports.
_CUDA_IMPORT_CHECK = """
from amp_fused_ops import _loader
_loader._compile = None  # a load that tried to compile again would fail here
module = _loader.get_extension("cuda")
if module is None:
    raise SystemExit("the CUDA extension did not load: " + str(_loader.unavailable_reason("cuda")))
ops = sorted(name for name in dir(module) if name.startswith("multi_tensor_"))
print(f"imported {module.__file__} with {len(ops)} ops: {', '.join(ops)}")
"""


def _install_checkout(session: nox.Session, *requirements: str) -> None:
    """Install all five packages from this checkout, after torch and ``requirements``.

    Requirements the system site packages already satisfy (torch, as a rule) are not
    downloaded again.
    """
    session.install(TORCH_REQUIREMENT, "hatchling", *requirements)
    editables = [arg for package in PACKAGES for arg in ("-e", f"packages/{package}")]
    session.install("--no-deps", "--no-build-isolation", *editables)
    session.run("python", "-c", _CHECKOUT_GUARD, str(ROOT / "packages"), *IMPORT_NAMES.values())


def _has_test_files(folder: Path) -> bool:
    return folder.is_dir() and any(folder.rglob("test_*.py"))


def _torch_query(session: nox.Session, expression: str) -> str:
    """Evaluate a Python expression with torch imported, in the session's interpreter."""
    marker = "nox-torch-query="
    output = session.run(
        "python", "-c", f"import torch; print({marker!r} + str({expression}))", silent=True
    )
    lines = [line for line in str(output).splitlines() if line.startswith(marker)]
    if not lines:
        session.error(f"could not evaluate {expression!r} with torch:\n{output}")
    return lines[-1].removeprefix(marker)


def _cuda_available(session: nox.Session) -> bool:
    return _torch_query(session, "torch.cuda.is_available()") == "True"


@nox.session(venv_params=SYSTEM_SITE)
@nox.parametrize("package", [*PACKAGES, "integration"])
def tests(session: nox.Session, package: str) -> None:
    """Run one package's CPU tests (or tests/integration) against this checkout."""
    test_dir = "tests/integration" if package == "integration" else f"packages/{package}/tests"
    if not _has_test_files(ROOT / test_dir):
        if package == "integration":
            session.skip("no test files under tests/integration yet")
        session.error(f"no test files (test_*.py) under {test_dir}")
    # The integration tests run the demo and the examples: they plot (matplotlib) and load
    # scikit-learn's digits, which the system site packages need not have.
    extra = ["scikit-learn", "matplotlib"] if package == "integration" else []
    if package == "amp-fused-ops":
        # The fused norms' ONNX export is tested with both exporters (TorchScript: onnx;
        # dynamo: onnxscript too); both are pure-Python or wheels from PyPI.
        extra = ["onnx", "onnxscript"]
    _install_checkout(session, "pytest", "ninja", *extra)
    # pytest exits with 5 when it collected no test; nox treats every non-zero exit as failure.
    session.run("python", "-m", "pytest", test_dir, "-m", "not gpu", *session.posargs)


@nox.session(venv_params=SYSTEM_SITE)
def lint(session: nox.Session) -> None:
    """Check lint, formatting and types: ruff check, ruff format --check, mypy on each src/."""
    session.install("ruff", "mypy", TORCH_REQUIREMENT)
    session.run("python", "-m", "ruff", "check", ".")
    session.run("python", "-m", "ruff", "format", "--check", ".")
    session.run("python", "-m", "mypy", *SRC_DIRS)


@nox.session(venv_params=SYSTEM_SITE)
def build(session: nox.Session) -> None:
    """Build each package's sdist and wheel into dist/, then install and import each wheel."""
    session.install("build", "hatchling", "virtualenv")
    dist = ROOT / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for package in PACKAGES:
        session.run(
            "python", "-m", "build", "--no-isolation", "--outdir", str(dist), f"packages/{package}"
        )

    # One fresh virtualenv per wheel (system site packages give it torch). Sibling
    # dependencies may only come from dist/: --no-index keeps every index out.
    checks = Path(session.create_tmp()) / "wheel-checks"
    bin_dir = "Scripts" if os.name == "nt" else "bin"
    for package, name in IMPORT_NAMES.items():
        wheels = sorted(dist.glob(f"{name}-*.whl"))
        if len(wheels) != 1:
            session.error(f"expected one wheel of {package} in {dist}, found {wheels}")
        venv = checks / package
        shutil.rmtree(venv, ignore_errors=True)
        session.run("python", "-m", "virtualenv", "--quiet", "--system-site-packages", str(venv))
        python = str(venv / bin_dir / "python")
        session.run(
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--find-links",
            str(dist),
            str(wheels[0]),
            external=True,
        )
        session.run(python, "-c", _WHEEL_IMPORT_CHECK, name, str(venv), external=True)


@nox.session(venv_params=SYSTEM_SITE)
def docs(session: nox.Session) -> None:
    """Build the Sphinx site into docs/_build/html, treating warnings as errors."""
    session.install("sphinx", TORCH_REQUIREMENT)
    # -E re-reads every page, so warnings of unchanged pages are reported again.
    session.run(
        "python",
        "-m",
        "sphinx",
        "-W",
        "-E",
        "-b",
        "html",
        "docs",
        "docs/_build/html",
        *session.posargs,
    )


@nox.session(venv_params=SYSTEM_SITE)
def demo(session: nox.Session) -> None:
    """Run the demo, examples/demo/train_digits.py (arguments after -- go to the script)."""
    _install_checkout(session, "scikit-learn", "matplotlib")
    session.run("python", "examples/demo/train_digits.py", *session.posargs)


@nox.session(venv_params=SYSTEM_SITE)
def bench(session: nox.Session) -> None:
    """Run every benchmarks/bench_*.py on CPU, and on CUDA too when it is available."""
    _install_checkout(session)
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    if not scripts:
        session.error("no benchmark scripts (benchmarks/bench_*.py) found")
    devices = ["cpu", "cuda"] if _cuda_available(session) else ["cpu"]
    for script in scripts:
        for device in devices:
            session.run(
                "python", str(script.relative_to(ROOT)), "--device", device, *session.posargs
            )


@nox.session(venv_params=SYSTEM_SITE)
def gpu_tests(session: nox.Session) -> None:
    """Run the tests marked gpu under packages/ and tests/ with the installed CUDA torch."""
    if not _cuda_available(session):
        session.skip("CUDA not available")
    session.install("pytest")
    # Import from the source folders, as on GPU machines without an index (see GPU.md):
    # nothing else needs installing there.
    env = {"PYTHONPATH": os.pathsep.join(str(ROOT / src) for src in SRC_DIRS)}
    paths = [folder for folder in ("packages", "tests") if (ROOT / folder).is_dir()]
    session.run("python", "-m", "pytest", "-m", "gpu", *paths, *session.posargs, env=env)


@nox.session
def cuda_build(session: nox.Session) -> None:
    """Compile the CUDA extension of amp-fused-ops as users get it, then import it.

    Runs ``python -m amp_fused_ops build cuda --force`` (the loader's just-in-time build: every
    .cu/.cpp of csrc/cuda into one module) for ``TORCH_CUDA_ARCH_LIST`` (default 9.0), so it
    needs nvcc and a CUDA build of torch but no GPU, then loads the result.
    """
    relative = CUDA_SOURCE_DIR.relative_to(ROOT).as_posix()
    sources = sorted(CUDA_SOURCE_DIR.glob("*.cu")) if CUDA_SOURCE_DIR.is_dir() else []
    if not sources:
        session.skip(f"no CUDA sources under {relative} to compile")
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if shutil.which("nvcc") is None and not (Path(cuda_home) / "bin" / "nvcc").exists():
        session.skip(f"nvcc not found on PATH or in {cuda_home}/bin: cannot compile {relative}")

    # A CPU build of torch cannot compile CUDA extensions, so this session has its own
    # virtualenv (no system site packages) with a CUDA build of torch. AMP_CUDA_TORCH may name
    # another requirement or a local wheel, e.g. a torch 2.14.1+cu130 wheel.
    session.install(os.environ.get("AMP_CUDA_TORCH", TORCH_REQUIREMENT), "ninja")
    torch_cuda = _torch_query(session, "torch.version.cuda")
    if torch_cuda == "None":
        version = _torch_query(session, "torch.__version__")
        session.skip(
            f"torch {version} in this session is a CPU build (torch.version.cuda is None); "
            "set AMP_CUDA_TORCH to a CUDA build of torch to compile the CUDA sources"
        )
    env = {
        "CUDA_HOME": cuda_home,
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
        "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 1)),
        # A cache of this session's own: the build below always compiles (--force).
        "AMP_FUSED_OPS_CACHE": str(Path(session.create_tmp()) / "amp_fused_ops_cache"),
        "PYTHONPATH": str(ROOT / "packages" / "amp-fused-ops" / "src"),
    }
    session.run("python", "-m", "amp_fused_ops", "info", env=env)
    session.run("python", "-m", "amp_fused_ops", "build", "cuda", "--force", env=env)
    session.run("python", "-c", _CUDA_IMPORT_CHECK, env=env)

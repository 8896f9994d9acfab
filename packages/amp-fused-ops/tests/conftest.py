"""Shared setup for the amp_fused_ops tests: at most one real compile of the CPU extension per run.

The tests that need the CPU extension get it in a folder of the run's own
(``_cpu_extension_helpers.session_cache``): copied from the configured cache
(``$AMP_FUSED_OPS_CACHE`` or ``~/.cache/amp_fused_ops``) when that holds a build of these
sources, else compiled for real by two racing processes. Every other test reaches the extension
through the loader, which looks in the configured cache. On a machine whose cache holds no build
yet (a fresh clone, CI), the loader would compile a second, identical module there. Instead,
while these tests run, a compile of the CPU kind into the configured cache copies the run's build
(building it first if no test has yet); the loader then verifies the copy against its build
record and imports it as it would its own build. Builds into any other folder (the tests'
private caches) still compile for real.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from _cpu_extension_helpers import CONFIGURED_BUILD, copy_build, session_cache
from _op_paths import OpPath, open_path
from amp_fused_ops import extensions
from amp_fused_ops.extensions import _build as ext_build
from amp_fused_ops.extensions import _lookup as ext_lookup
from amp_fused_ops.extensions import _record as ext_record


@pytest.fixture(scope="session", autouse=True)
def _configured_cache_reuses_the_run_build(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    compile_for_real = ext_build.compile_extension

    def compile_or_copy(kind: str, build_dir: Path) -> ModuleType:
        if kind != "cpu" or Path(build_dir).resolve() != CONFIGURED_BUILD:
            return compile_for_real(kind, build_dir)
        run_build = session_cache(tmp_path_factory).cache / CONFIGURED_BUILD.name
        if ext_record.verified_module(run_build) is None:
            return compile_for_real(kind, build_dir)  # nothing to copy (cannot happen)
        # The loader holds the build lock of `build_dir`: replace what it holds, then copy.
        ext_build.clean(build_dir)
        copy_build(run_build, build_dir)
        module = ext_record.verified_module(build_dir)
        assert module is not None, f"the copy of {run_build} in {build_dir} does not verify"
        return ext_lookup.import_or_explain(module)

    ext_build.compile_extension = compile_or_copy
    try:
        yield
    finally:
        ext_build.compile_extension = compile_for_real


@pytest.fixture
def cpu_extension() -> object:
    """The compiled CPU extension (a test that needs it is skipped where it cannot be built)."""
    module = extensions.get_extension("cpu")
    if module is None:
        pytest.skip(f"no compiled CPU extension: {extensions.unavailable_reason('cpu')}")
    return module


@pytest.fixture
def path(request: pytest.FixtureRequest) -> Iterator[OpPath]:
    """The path a contract test runs its op on (``_op_paths.py``); parametrise it indirectly
    with ``_op_paths.paths(...)``."""
    yield from open_path(request.param, request)

"""Command line of ``amp_fused_ops``: ``python -m amp_fused_ops info|build|--version``.

``info`` says what this machine has (torch, CUDA, compiler, ninja) and, for each extension,
whether it is prebuilt, built, buildable or unavailable and why. ``build`` compiles what this
machine can (the C++ CPU extension; the CUDA extension where torch is a CUDA build and nvcc
is found) and exits non-zero when a build fails. ``build cuda`` (a kind named explicitly)
also fails when that kind cannot be built here, instead of skipping it::

    TORCH_CUDA_ARCH_LIST=9.0 python -m amp_fused_ops build cuda   # works without a GPU

``build --force`` compiles from scratch whatever the cache holds. ``build KIND --wheel-dir DIR``
compiles the portable modules a wheel ships for this torch (the CPU kind: one per instruction
set, AVX2 and AVX-512 on x86-64) and writes them with their notes into DIR, for
``AMP_FUSED_OPS_PREBUILT_DIRS`` of a wheel build (``packages/amp-fused-ops/hatch_build.py``).
Failures (a compiler error,
an unwritable cache, another build holding the lock too long) print one line that says what
to do, and exit with status 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from amp_fused_ops._version import __version__
from amp_fused_ops.extensions import _flags, _loader


def _info() -> int:
    """Print the toolchain and the state of every extension kind; always returns 0."""
    print(f"amp-fused-ops: {__version__}")
    print(f"torch:        {torch.__version__}")
    print(f"CUDA:         {torch.version.cuda if torch.version.cuda else 'CPU build'}")
    print(f"compiler:     {_loader.compiler_path() or 'not found (set CXX or install g++)'}")
    print(f"ninja:        {_loader.ninja_path() or 'not found (pip install ninja)'}")
    nvcc = _loader.nvcc_path()
    version = _loader.nvcc_version(nvcc) if nvcc is not None else None
    release = f" (CUDA {version[0]}.{version[1]})" if version is not None else ""
    print(f"nvcc:         {nvcc + release if nvcc else 'not found (set CUDA_HOME)'}")
    archs = _loader.cuda_arch_list() if torch.version.cuda else None
    print(f"CUDA archs:   {archs or f'none (no GPU visible and {_loader.ARCH_ENV} unset)'}")
    source = _loader.source_dir()
    print(f"sources:      {source if source is not None else 'not shipped'}")
    configured = os.environ.get(_loader.CACHE_ENV)
    origin = (
        f"{_loader.CACHE_ENV}={configured}"
        if configured
        else f"default; {_loader.CACHE_ENV} moves it"
    )
    print(f"cache:        {_loader.cache_root()} ({origin})")
    for kind in _loader.KINDS:
        status = _loader.extension_status(kind)
        print(f"{kind} extension: {status.state} ({status.detail})")
    return 0


def _build_for_wheel(kind: str, out_dir: str, isas: Sequence[str] | None) -> int:
    """Write the portable modules of ``kind`` into ``out_dir``; returns 1 if one failed."""
    try:
        paths = _loader.build_for_wheel(kind, Path(out_dir), isas=isas)
    except (_loader.ExtensionUnavailableError, OSError) as error:
        print(f"{kind} extension: FAILED: {error}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"{kind} extension: wrote {path}")
    return 0


def _build(kinds: Sequence[str], force: bool, *, explicit: bool) -> int:
    """Build each kind this machine can; returns 1 if a build failed, else 0.

    Without ``explicit`` (``build`` or ``build all``), a CUDA extension that cannot be built
    here is skipped with its reason; a kind named explicitly fails instead.
    """
    failed = False
    for kind in kinds:
        status = _loader.extension_status(kind)
        if kind == "cuda" and status.state == "unavailable" and not explicit:
            print(f"cuda extension: skipped ({status.detail})")
            continue
        # A portable build (for a wheel) goes to the cache whatever the installed wheel ships.
        done = ("built",) if os.environ.get(_loader.PORTABLE_ENV) else ("built", "prebuilt")
        if status.state in done and not force:
            print(f"{kind} extension: already {status.state} ({status.detail}); --force rebuilds")
            continue
        try:
            path = _loader.build_extension(kind, force=True)
        except (_loader.ExtensionUnavailableError, OSError) as error:
            print(f"{kind} extension: FAILED: {error}", file=sys.stderr)
            failed = True
        else:
            print(f"{kind} extension: built {path}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` when ``None``.

    Returns:
        The exit status: 0 on success, 1 when a build failed, 2 on a usage error.
    """
    parser = argparse.ArgumentParser(
        prog="python -m amp_fused_ops", description="Inspect and build the compiled extensions."
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"amp-fused-ops {__version__} (torch {torch.__version__})",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="say what is built, buildable or unavailable, and why")
    build = commands.add_parser("build", help="compile the extensions this machine can build")
    build.add_argument(
        "kind",
        nargs="?",
        choices=[*_loader.KINDS, "all"],
        default=None,
        help="which extension (default: all); a kind named here fails if it cannot be built",
    )
    build.add_argument(
        "--kind",
        dest="kind_option",
        choices=[*_loader.KINDS, "all"],
        default=None,
        help="same as the positional argument",
    )
    build.add_argument(
        "--force",
        action="store_true",
        help="compile again from scratch, whatever the cache holds",
    )
    build.add_argument(
        "--wheel-dir",
        metavar="DIR",
        default=None,
        help="write the portable modules a wheel ships for this torch into DIR (one kind)",
    )
    build.add_argument(
        "--isa",
        action="append",
        choices=[*_flags.CPU_ISAS, "best"],
        default=None,
        help="with --wheel-dir and the cpu kind: only this instruction set (repeatable; best: "
        "the best one this CPU runs; default: AVX2 and AVX-512 on x86-64)",
    )
    args = parser.parse_args(argv)
    # An application entry point may configure logging (the library never does).
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "info":
        return _info()
    if args.kind is not None and args.kind_option is not None and args.kind != args.kind_option:
        parser.error(f"build: kind {args.kind!r} and --kind {args.kind_option!r} disagree")
    chosen = args.kind or args.kind_option or "all"
    if args.isa is not None and (args.wheel_dir is None or chosen != "cpu"):
        parser.error("build --isa: only with --wheel-dir and the cpu kind")
    if args.wheel_dir is not None:
        if chosen == "all" or args.force:
            parser.error("build --wheel-dir: name one kind (cpu or cuda), without --force")
        isas = None
        if args.isa is not None:
            isas = [_flags.host_isas()[0] if isa == "best" else isa for isa in args.isa]
        return _build_for_wheel(chosen, args.wheel_dir, isas)
    kinds = list(_loader.KINDS) if chosen == "all" else [chosen]
    return _build(kinds, args.force, explicit=chosen != "all")


if __name__ == "__main__":
    sys.exit(main())

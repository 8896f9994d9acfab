"""Run a script written for NVIDIA Apex on the amp toolkit, unchanged.

Usage::

    python -m amp_legacy_fp16.apex_run train.py --epochs 3
    python -m amp_legacy_fp16.apex_run -m package.module --epochs 3
    torchrun --nproc-per-node 2 -m amp_legacy_fp16.apex_run train.py --epochs 3

The script runs as ``python train.py ...`` would (``__name__ == "__main__"``, ``sys.argv`` and
``sys.path[0]`` as Python sets them), with ``apex``, ``apex.amp``, ``apex.optimizers``,
``apex.normalization``, ``apex.multi_tensor_apply``, ``apex.parallel``, ``apex.fp16_utils``
(and their submodules) and the top-level ``amp_C`` resolving to the installed toolkit packages
(see :mod:`amp_legacy_fp16._apex_alias`); nothing named ``apex`` is installed. A module whose
toolkit package is missing raises ``ModuleNotFoundError`` naming the pip package.

Processes the script starts inherit the aliases, whatever their start method: ``fork``
children share the parent's import hook, and every new interpreter (``multiprocessing`` with
``spawn`` or ``forkserver``, ``torch.multiprocessing.spawn``, ``subprocess`` running ``python``)
finds it through its environment: ``apex_run`` sets ``AMP_APEX_RUN=1`` and puts a start-up
folder first on ``PYTHONPATH``, whose ``sitecustomize`` installs the aliases when an Apex name is
first imported (and then runs any ``sitecustomize`` it shadows).
"""

from __future__ import annotations

import os
import runpy
import sys

from amp_legacy_fp16._apex_alias import install

__all__ = ["BOOT_DIR", "export_to_children", "main"]

BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_apex_boot")
"""The start-up folder (its ``sitecustomize``) that gives new interpreters the aliases."""

USAGE = (
    "usage: python -m amp_legacy_fp16.apex_run SCRIPT.py [ARGS...]\n"
    "       python -m amp_legacy_fp16.apex_run -m MODULE [ARGS...]\n"
    "Runs a script written for NVIDIA Apex with `import apex` resolving to the amp toolkit.\n"
)


def export_to_children() -> None:
    """Make every Python process started from now on resolve ``import apex`` as this one:
    ``AMP_APEX_RUN=1`` and :data:`BOOT_DIR` first on ``PYTHONPATH`` (once)."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if BOOT_DIR not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, *entries])
    os.environ["AMP_APEX_RUN"] = "1"


def main(argv: list[str] | None = None) -> int:
    """Install the Apex aliases and run the script or module named by ``argv``.

    Args:
        argv: ``[script, *args]`` or ``["-m", module, *args]`` (default: ``sys.argv[1:]``).

    Returns:
        0 once the script returns (its ``sys.exit`` codes propagate as ``SystemExit``); 2 for
        a usage error.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stderr.write(USAGE)
        return 0 if args else 2
    install()
    export_to_children()
    if args[0] == "-m":
        if len(args) < 2:
            sys.stderr.write(USAGE)
            return 2
        sys.argv = args[1:]
        sys.path[0] = os.getcwd()  # as `python -m MODULE` sets it
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return 0
    script = args[0]
    if not os.path.exists(script):
        sys.stderr.write(f"apex_run: can't open file {script!r}: no such file\n")
        return 2
    sys.argv = args
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fail unless every named amp_* module resolves to this checkout's packages/ folder, and
every module named after ``--absent`` cannot be found at all.

Usage: python .ci/checkout_guard.py <checkout>/packages amp_core ... [--absent amp_parallel ...]

Run by the nox sessions that install the checkout (editable), so that a sibling package pulled
from an index (or installed elsewhere) cannot stand in for ours, and so that a package's test
session has none of the toolkit packages that package does not require (neither the module nor
its distribution's metadata). ``find_spec`` locates a module without importing it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import sys


def main(root: pathlib.Path, names: list[str], absent: list[str]) -> int:
    bad = []
    for name in names:
        spec = importlib.util.find_spec(name)
        origin = pathlib.Path(spec.origin).resolve() if spec and spec.origin else None
        if origin is None or not origin.is_relative_to(root):
            bad.append(f"{name} -> {origin}")
    if bad:
        print(f"these modules do not come from {root}: " + ", ".join(bad), file=sys.stderr)
        return 1
    present = []
    for name in absent:
        spec = importlib.util.find_spec(name)
        if spec is not None:
            present.append(f"module {name} -> {spec.origin}")
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        present.append(
            f"distribution {dist.metadata['Name']} {dist.version} at {dist.locate_file('')}"
        )
    if present:
        print(
            "these toolkit packages must not be installed in this session: " + ", ".join(present),
            file=sys.stderr,
        )
        return 1
    message = f"checkout guard: from {root}: {', '.join(names)}"
    if absent:
        message += f"; not installed: {', '.join(absent)}"
    print(message)
    return 0


if __name__ == "__main__":
    args = sys.argv[2:]
    split = args.index("--absent") if "--absent" in args else len(args)
    sys.exit(main(pathlib.Path(sys.argv[1]).resolve(), args[:split], args[split + 1 :]))

"""Fail unless every amp_* module resolves to this checkout's packages/ folder.

Usage: python .ci/checkout_guard.py <checkout>/packages amp_core amp_fused_ops ...

Run by the nox sessions that install the checkout (editable), so that a sibling package pulled
from an index (or installed elsewhere) cannot stand in for ours. ``find_spec`` locates a
module without importing it.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys


def main(root: pathlib.Path, names: list[str]) -> int:
    bad = []
    for name in names:
        spec = importlib.util.find_spec(name)
        origin = pathlib.Path(spec.origin).resolve() if spec and spec.origin else None
        if origin is None or not origin.is_relative_to(root):
            bad.append(f"{name} -> {origin}")
    if bad:
        print(f"these modules do not come from {root}: " + ", ".join(bad), file=sys.stderr)
        return 1
    print(f"checkout guard: all amp_* modules come from {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1]).resolve(), sys.argv[2:]))

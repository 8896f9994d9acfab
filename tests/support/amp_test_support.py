"""What the tests of every package share (on ``sys.path`` through pytest's ``pythonpath``).

Helpers that several packages' tests need live here once, instead of a copy per package.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

__all__ = ["exit_passed_rank"]


def exit_passed_rank() -> NoReturn:
    """End a spawned Gloo rank whose checks passed, without interpreter shutdown.

    DTensor's caches keep the device mesh, and through it the process group, alive past
    ``destroy_process_group``. A Gloo worker thread can then release the tensors of the last
    collective while the interpreter shuts down, and the process aborts ("terminate called
    without an active exception", PyTorch issue 190489): ``mp.spawn`` would report a rank
    that passed as failed. A rank that raised still exits through ``mp.spawn``, which
    reports its traceback.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

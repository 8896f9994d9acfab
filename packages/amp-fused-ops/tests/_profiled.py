"""Counting the Python calls of given functions while a block runs (``sys.setprofile``)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["profiled"]


@contextmanager
def profiled(*functions: Callable[..., Any]) -> Iterator[dict[str, int]]:
    """Counts the Python calls of ``functions`` (unwrapped: a decorator's frame is shared)."""
    codes = {inspect.unwrap(f).__code__: f.__name__ for f in functions}
    counts = dict.fromkeys(codes.values(), 0)

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(previous)

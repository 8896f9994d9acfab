"""Integration tests share one process per session: none may leave amp switched on.

A test that calls ``amp.initialize`` (O1 switches casting on for the thread) and returns without
``amp.close()`` would change the numbers of every test after it in the same process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from amp_core import amp


@pytest.fixture(autouse=True)
def _amp_closed_after_each_test() -> Iterator[None]:
    yield
    amp.close()

"""Apex's ``verbosity=1`` summary of ``amp.initialize``, through ``logging``.

Apex printed the selected opt level and its properties, and its users read that block to
check their setup. The toolkit logs it at INFO on the ``amp_core`` logger. Python shows only
warnings when an application has not configured logging (``logging.lastResort``), so in that
one case, and for this one summary, the record goes to ``sys.stderr`` through a private
handler, as Apex's print did. Nothing is attached to any logger, so:

- ``verbosity=0`` logs nothing;
- once the application configures logging (a handler on the root or on ``amp_core``, or a
  level on ``amp_core``), the summary follows that configuration like any INFO record, e.g.
  ``logging.basicConfig()`` (WARNING) hides it and ``logging.basicConfig(level=logging.INFO)``
  shows it once;
- ``logging.disable`` silences it.
"""

from __future__ import annotations

import logging
import sys

import torch

__all__ = ["logging_configured", "show_setup"]


class _StderrHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at the time of the call (as ``lastResort`` does)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


_FALLBACK = _StderrHandler(logging.INFO)
_FALLBACK.setFormatter(logging.Formatter("%(message)s"))


def logging_configured(logger: logging.Logger) -> bool:
    """Whether the application configured logging for ``logger``.

    Configured means a handler on the logger or one of its parents, a level set on the logger
    or a parent below the root, or a root level other than Python's default (WARNING).
    """
    if logger.hasHandlers():
        return True
    node: logging.Logger | None = logger
    while node is not None and node is not logging.root:
        if node.level != logging.NOTSET:
            return True
        node = node.parent
    return logging.root.level != logging.WARNING


def _other_rank() -> bool:
    """True on every rank but 0 of a multi-process job (Apex printed the summary on rank 0)."""
    dist = torch.distributed
    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
        and dist.get_rank() != 0
    )


def show_setup(logger: logging.Logger, message: str) -> None:
    """Log ``message`` at INFO; print it to stderr when logging is not configured at all."""
    if _other_rank() or logger.disabled or logging.root.manager.disable >= logging.INFO:
        return
    if logging_configured(logger):
        logger.info(message)
        return
    record = logger.makeRecord(logger.name, logging.INFO, "(amp_core)", 0, message, (), None)
    _FALLBACK.handle(record)

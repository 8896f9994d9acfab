"""Placeholder for ``amp-parallel``: the API of this package is not implemented yet.

Version 0.0.1 only reserves the distribution name and the import path
``amp_parallel``. It exports nothing but ``__version__``; the Apex names this package
will hold (``SyncBatchNorm``, ...) do not exist yet, and importing them
raises ``ImportError``. The package README lists what is planned.
"""

from amp_parallel._version import __version__

__all__ = ["__version__"]

"""Placeholder for ``amp-fused-ops``: the API of this package is not implemented yet.

Version 0.0.1 only reserves the distribution name and the import path
``amp_fused_ops``. It exports nothing but ``__version__``; the Apex names this package
will hold (``FusedLayerNorm``, ``multi_tensor_applier``, ...) do not exist yet, and importing them
raises ``ImportError``. The package README lists what is planned.
"""

from amp_fused_ops._version import __version__

__all__ = ["__version__"]

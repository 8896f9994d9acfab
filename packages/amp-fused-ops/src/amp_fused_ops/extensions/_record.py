"""The build record beside every compiled module: what it was built for, its size and SHA-256.

A module is loaded only when its bytes match its record, so a file truncated or overwritten
after the build (a full disk, a killed copy, a stray write) is compiled again, or skipped for
the reference path, instead of crashing the process that maps it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from ._settings import MARKER, ExtensionUnavailableError


class DamagedBuildError(ExtensionUnavailableError):
    """A build folder's record is unreadable, or its module does not match the record."""


def python_tag() -> str:
    """``"3.11"``: the Python a module is built for."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def file_digest(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of ``path``."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def write_record(build_dir: Path, module: Path, meta: dict[str, Any]) -> None:
    """Write the record of ``module`` (atomically, last: a folder with a record is finished)."""
    record = {"file": module.name, **file_digest(module), **meta}
    tmp = build_dir / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(build_dir / MARKER)


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises:
        DamagedBuildError: If the file cannot be read or is not a JSON object (with a hint).
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedBuildError(
            f"the build record {path} is unreadable ({type(error).__name__}: {error}); it was "
            "probably cut short (a full disk or a killed process)"
        ) from error
    if not isinstance(data, dict):
        raise DamagedBuildError(f"the build record {path} holds no JSON object: {data!r}")
    return data


def mismatch(path: Path, record: dict[str, Any]) -> str | None:
    """How the file ``path`` differs from ``record`` (size first, then SHA-256), or None."""
    if "size" not in record or "sha256" not in record:
        return "the record has no checksum (it was written by an older amp-fused-ops)"
    if not path.is_file():
        return f"{path} is missing"
    try:
        actual = file_digest(path)
    except OSError as error:
        return f"{path} cannot be read ({type(error).__name__}: {error})"
    if actual["size"] != record["size"]:
        return (
            f"{path} has {actual['size']} bytes, the build wrote {record['size']} (it was "
            "truncated or replaced after the build)"
        )
    if actual["sha256"] != record["sha256"]:
        return (
            f"the SHA-256 of {path} differs from the one recorded at build time (it was "
            "overwritten after the build)"
        )
    return None


def verified_module(build_dir: Path) -> Path | None:
    """The module of a finished build in ``build_dir``, once its bytes match its record.

    Returns:
        The module's path, or ``None`` when the folder holds no finished build.

    Raises:
        DamagedBuildError: If the record is unreadable or the module does not match it.
    """
    marker = build_dir / MARKER
    if not marker.is_file():
        return None
    record = read_json(marker)
    path = build_dir / str(record.get("file", ""))
    problem = mismatch(path, record)
    if problem is not None:
        raise DamagedBuildError(
            f"the compiled module in {build_dir} does not match its build record: {problem}"
        )
    return path

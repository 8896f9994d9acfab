"""The verbosity=1 summary of amp.initialize: seen without logging set up, silenced as usual."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator

import pytest
import torch

from _amp_core_helpers import tiny_mlp
from amp_core import amp


@contextlib.contextmanager
def _logging_as_in_a_plain_script() -> Iterator[logging.Logger]:
    """No handler and default levels everywhere (pytest's capture handlers set aside)."""
    root, amp_logger = logging.getLogger(), logging.getLogger("amp_core")
    saved = (root.handlers[:], root.level, amp_logger.handlers[:], amp_logger.level)
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    amp_logger.handlers.clear()
    amp_logger.setLevel(logging.NOTSET)
    try:
        yield root
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        amp_logger.handlers[:] = saved[2]
        amp_logger.setLevel(saved[3])


def _initialize(verbosity: int = 1) -> None:
    model = tiny_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(
        model,
        optimizer,
        opt_level="O2",
        half_dtype=torch.bfloat16,
        loss_scale=128.0,
        verbosity=verbosity,
    )


def test_summary_printed_to_stderr_when_logging_is_not_configured(capsys):
    with _logging_as_in_a_plain_script():
        _initialize()
    err = capsys.readouterr().err
    assert err.startswith("Selected optimization level O2: "), err
    assert "{'loss_scale': 128.0}" in err  # the user's override
    expected = {
        "opt_level": "O2",
        "master_weights": "True",
        "loss_scale": "128.0",
        "half_dtype": "torch.bfloat16",
    }
    for name, value in expected.items():
        assert f"{name:22} : {value}" in err.splitlines(), err


def test_verbosity_zero_prints_nothing(capsys):
    with _logging_as_in_a_plain_script():
        _initialize(verbosity=0)
    assert capsys.readouterr().err == ""


def test_configured_logging_at_warning_hides_the_summary(capsys):
    stream = io.StringIO()
    with _logging_as_in_a_plain_script() as root:
        root.addHandler(logging.StreamHandler(stream))  # what logging.basicConfig() does
        _initialize()
    assert capsys.readouterr().err == ""
    assert stream.getvalue() == ""


def test_configured_logging_at_info_shows_the_summary_once(capsys):
    stream = io.StringIO()
    with _logging_as_in_a_plain_script() as root:
        root.addHandler(logging.StreamHandler(stream))
        root.setLevel(logging.INFO)
        _initialize()
    assert capsys.readouterr().err == ""  # through the application's handler only
    assert stream.getvalue().count("Selected optimization level O2") == 1


@pytest.mark.parametrize("silence", ["logger_level", "logging_disable"])
def test_ordinary_logging_calls_silence_the_summary(capsys, silence):
    with _logging_as_in_a_plain_script():
        if silence == "logger_level":
            logging.getLogger("amp_core").setLevel(logging.WARNING)
            _initialize()
        else:
            logging.disable(logging.INFO)
            try:
                _initialize()
            finally:
                logging.disable(logging.NOTSET)
    assert capsys.readouterr().err == ""

"""The ``apex`` import hook behind ``python -m amp_legacy_fp16.apex_run`` (in this process).

The end-to-end runs (a script importing every alias, ``torchrun`` with two ranks) are in
``tests/integration/test_apex_run.py``, and the aliases of amp-fused-ops' and amp-optimizers'
modules in ``tests/integration/test_apex_alias_other_packages.py``; these need only amp-core
and this package.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import amp_legacy_fp16
from amp_core import amp as core_amp
from amp_legacy_fp16 import _apex_alias
from amp_legacy_fp16 import amp as legacy_amp


def _real_apex_installed() -> bool:
    _apex_alias.uninstall()
    return importlib.util.find_spec("apex") is not None


pytestmark = pytest.mark.skipif(
    _real_apex_installed(), reason="a real apex is installed in this environment"
)


@pytest.fixture
def hook() -> Iterator[None]:
    _apex_alias.install()
    yield
    _apex_alias.uninstall()
    sys.modules.pop("amp_C", None)


def test_probes_find_apex_only_while_the_hook_is_installed(hook: None) -> None:
    # What transformers' is_apex_available does: find_spec, then the distribution's version.
    assert importlib.util.find_spec("apex") is not None
    assert importlib.metadata.version("apex") == _apex_alias.APEX_VERSION
    assert importlib.metadata.metadata("apex")["Name"] == "apex"
    _apex_alias.uninstall()
    assert importlib.util.find_spec("apex") is None
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("apex")


def test_install_twice_keeps_one_hook(hook: None) -> None:
    _apex_alias.install()
    hooks = [f for f in sys.meta_path if isinstance(f, _apex_alias.ApexAliasFinder)]
    assert len(hooks) == 1


def test_apex_amp_is_amp_core_plus_the_legacy_init(hook: None) -> None:
    import apex
    from apex import amp

    assert apex.amp is amp
    apex_names = [
        "init", "half_function", "float_function", "promote_function",
        "register_half_function", "register_float_function", "register_promote_function",
        "scale_loss", "disable_casts", "initialize", "state_dict", "load_state_dict",
        "master_params",
    ]  # fmt: skip
    for name in apex_names:
        expected = getattr(legacy_amp if name == "init" else core_amp, name)
        found = getattr(amp, name)
        # initialize adds Apex's deprecation warning in front of amp-core's
        assert (found.__wrapped__ if name == "initialize" else found) is expected, name


def test_apex_fp16_utils_and_its_submodules(hook: None) -> None:
    apex_names = [
        "BN_convert_float", "network_to_half", "prep_param_lists",
        "model_grads_to_master_grads", "master_params_to_model_params", "tofp16",
        "to_python_float", "clip_grad_norm", "convert_module", "convert_network", "FP16Model",
        "FP16_Optimizer", "LossScaler", "DynamicLossScaler",
    ]  # fmt: skip
    fp16_utils = importlib.import_module("apex.fp16_utils")
    for name in apex_names:
        assert getattr(fp16_utils, name) is getattr(amp_legacy_fp16, name), name
    from apex.fp16_utils.fp16_optimizer import FP16_Optimizer
    from apex.fp16_utils.fp16util import network_to_half
    from apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler

    assert FP16_Optimizer is amp_legacy_fp16.FP16_Optimizer
    assert network_to_half is amp_legacy_fp16.network_to_half
    assert (LossScaler, DynamicLossScaler) == (
        amp_legacy_fp16.LossScaler,
        amp_legacy_fp16.DynamicLossScaler,
    )
    assert not hasattr(fp16_utils, "amp")  # amp_legacy_fp16's own amp is not apex.fp16_utils'


def test_a_missing_toolkit_package_names_the_documented_install_commands(
    hook: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes `import amp_optimizers` fail as if it were not installed.
    monkeypatch.setitem(sys.modules, "amp_optimizers", None)
    with pytest.raises(ModuleNotFoundError, match="not on PyPI yet") as info:
        importlib.import_module("apex.optimizers")
    assert info.value.name == "apex.optimizers"
    # The commands README.md documents, not a bare `pip install` of an unpublished name.
    message = str(info.value)
    assert "pip install --find-links dist amp-optimizers " in message, message
    git = 'pip install "amp-optimizers @ git+$REPO#subdirectory=packages/amp-optimizers"'
    assert git in message, message
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert "pip install --find-links dist amp-optimizers\n" in readme
    assert git in readme
    with pytest.raises(ImportError, match="amp-optimizers"):
        exec("from apex.optimizers import FusedAdam", {})
    assert "apex.optimizers" not in sys.modules


def test_an_apex_module_the_toolkit_lacks_is_not_found(hook: None) -> None:
    assert importlib.util.find_spec("apex.contrib.xentropy") is None
    with pytest.raises(ModuleNotFoundError, match=r"apex\.transformer"):
        importlib.import_module("apex.transformer")
    import apex

    with pytest.raises(AttributeError, match="no attribute 'RNN'"):
        _ = apex.RNN


def test_a_real_apex_already_imported_is_not_mixed_with_the_aliases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = types.ModuleType("apex")
    fake.__file__ = "/site-packages/apex/__init__.py"
    monkeypatch.setitem(sys.modules, "apex", fake)
    with pytest.raises(RuntimeError, match="a module named apex is imported already"):
        _apex_alias.install()
    assert not _apex_alias.installed()


def test_uninstall_forgets_the_alias_modules(hook: None) -> None:
    importlib.import_module("apex.amp")
    assert "apex.amp" in sys.modules
    _apex_alias.uninstall()
    assert "apex" not in sys.modules and "apex.amp" not in sys.modules


def test_apex_deprecated_feature_warning_is_the_legacy_apis_warning(hook: None) -> None:
    import apex

    assert apex.DeprecatedFeatureWarning is amp_legacy_fp16.DeprecatedFeatureWarning
    assert issubclass(apex.DeprecatedFeatureWarning, FutureWarning)
    with pytest.warns(apex.DeprecatedFeatureWarning, match="my message"):
        apex.deprecated_warning("my message")
    # What Apex's own deprecation tests check, call by call.
    model = torch.nn.Linear(1, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), 1.0)
    with pytest.warns(apex.DeprecatedFeatureWarning):
        apex.fp16_utils.FP16Model(model)
    with pytest.warns(apex.DeprecatedFeatureWarning):
        apex.fp16_utils.FP16_Optimizer(optimizer)
    with pytest.warns(apex.DeprecatedFeatureWarning):
        apex.fp16_utils.LossScaler()
    try:
        with pytest.warns(apex.DeprecatedFeatureWarning, match="from amp_core import amp"):
            apex.amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    finally:
        core_amp.close()


def test_apex_amp_initialize_warns_only_under_the_apex_name(hook: None) -> None:
    model = torch.nn.Linear(1, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), 1.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", amp_legacy_fp16.DeprecatedFeatureWarning)
            core_amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    finally:
        core_amp.close()

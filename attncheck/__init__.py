"""attncheck: prove that a multi-head attention implementation matches torch.nn.MultiheadAttention.

The Python API, for a user's own tests::

    import attncheck
    attncheck.check("configs/causal.yaml", "grad", impl=MyAttention).assert_passed()

In a parametrized pytest test, over every case x command of a suite file::

    @pytest.mark.parametrize("check", attncheck.cases("tests/attncheck_mha.yaml", impl=MyAttention))
    def test_attention(check):
        check.assert_passed()

`check`, `cases`, `Report`, `Config` and `load_config` are imported on first use, so `import attncheck`
(and `attncheck --help`) never imports torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "check": ("attncheck.api", "check"),
    "Report": ("attncheck.report", "Report"),
    "Config": ("attncheck.config", "Config"),
    "load_config": ("attncheck.config", "load_config"),
    "cases": ("attncheck.pytest_plugin", "cases"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'attncheck' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

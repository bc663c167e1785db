"""The config's dtype names as NumPy dtypes, half precision included (NumPy only).

float16 is NumPy's own; bfloat16 is `ml_dtypes.bfloat16` (the type JAX uses), whose NumPy
dtype has kind "V", so code asking "is this a float array" asks `is_float` here.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

HALF = ("float16", "bfloat16")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def np_dtype(name: str | np.dtype) -> np.dtype:
    """The NumPy dtype of a config's `dtype` name."""
    return BFLOAT16 if str(name) == "bfloat16" else np.dtype(name)


def is_float(dtype: np.dtype) -> bool:
    """Whether arrays of this dtype hold floating-point numbers (bfloat16 included)."""
    return np.dtype(dtype).kind == "f" or np.dtype(dtype) == BFLOAT16


def eps(dtype: str | np.dtype) -> float:
    """The dtype's machine epsilon: 2^-7 for bfloat16, 2^-10 float16, 2^-23 float32."""
    return float(ml_dtypes.finfo(np_dtype(dtype)).eps)

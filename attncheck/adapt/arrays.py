"""Arrays of any library read on the host and handed back in their own library, and the shape
checks every adapt helper makes (NumPy only: torch and JAX are imported only where their arrays
were handed in, so already loaded). Dimensions as in attncheck.adapt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from attncheck.dtypes import BFLOAT16

Array = np.ndarray


def _check_shape(what: str, array: Any, shape: tuple[int, ...]) -> Array:
    array = np.asarray(array)
    if array.shape != shape:
        raise ValueError(f"{what}: expected shape {shape}, got {array.shape}")
    return array


def _vector(what: str, array: Any, n: int) -> Array:
    """A bias gradient as (n,): (n,), (n, 1) column and (1, n) or (1, 1, n) row forms are accepted."""
    array = np.asarray(array)
    if array.size != n or any(d not in (1, n) for d in array.shape):
        raise ValueError(f"{what}: expected shape ({n},) (or a ({n}, 1) column), got {array.shape}")
    return array.reshape(n)


# The mask helpers compute on the host in NumPy, whatever library the masks come in: a mask is
# data, never differentiated. What they return is in the masks' own library (torch or JAX) and,
# for torch, on the masks' device.


def _library(*arrays: Any) -> str:
    """"torch", "jax" or "numpy": the library of the first array that is not NumPy's (or None)."""
    for a in arrays:
        if a is None or isinstance(a, np.ndarray):
            continue
        root = type(a).__module__.split(".")[0]
        if root == "torch":
            return "torch"
        if root in ("jax", "jaxlib"):
            return "jax"
    return "numpy"


def _host(a: Any) -> Array | None:
    """An array of any library as a NumPy array on the host (a torch tensor detached first; bfloat16
    tensors, which NumPy cannot read, as float32: every bfloat16 value is a float32)."""
    if a is None or isinstance(a, np.ndarray):
        return a
    if _library(a) == "torch":
        a = a.detach().cpu()
        if a.is_floating_point() and str(a.dtype) == "torch.bfloat16":
            a = a.float()
        return a.numpy()
    return np.asarray(a)


def numpy_dtype(dtype: Any) -> np.dtype:
    """Any library's dtype as NumPy's: torch.float32, jnp.float32, np.float32, "float32", bool,
    torch.bool; bfloat16 (torch's, JAX's or the name) as ml_dtypes.bfloat16."""
    if type(dtype).__module__.split(".")[0] == "torch":  # torch.dtype: NumPy cannot read it
        dtype = str(dtype).removeprefix("torch.")
    if isinstance(dtype, str) and dtype == "bfloat16":
        return BFLOAT16
    try:
        return np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype {dtype!r}: not a dtype NumPy, torch or JAX names") from None


def _in_library(result: Array | None, like: Sequence[Any], dtype: np.dtype, asked: Any) -> Any:
    """A NumPy result in the library of the first non-NumPy array of `like` (torch: on its device),
    of `dtype` (`asked`, the caller's own dtype object, where that is torch's)."""
    library = _library(*like)
    if result is None or library == "numpy":
        return result
    if library == "torch":
        import torch  # already loaded: the masks are its tensors

        device = next(a for a in like if a is not None and _library(a) == "torch").device
        target = asked if isinstance(asked, torch.dtype) else getattr(torch, dtype.name)
        readable = result.astype(np.float32) if dtype == BFLOAT16 else result  # torch cannot read ml_dtypes' bfloat16
        return torch.from_numpy(np.ascontiguousarray(readable)).to(device=device, dtype=target)
    import jax.numpy as jnp  # already loaded: the masks are its arrays

    return jnp.asarray(result, dtype=dtype)

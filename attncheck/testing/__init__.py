"""Test helpers shipped with attncheck (like numpy.testing), for its own tests and benchmarks.

- `attncheck.testing.wrong_impls`: known-bad implementations, each a small subclass of the
  reference whose docstring names its bug, plus one wrong SGD; usable as
  `--impl attncheck.testing.wrong_impls:NAME`.
- `attncheck.testing.detection`: which command catches each of them, on which rows, and where
  each bug cannot show; and how to run one such case.
- `attncheck.testing.wrong_kernels`: known-bad kernels of `module: sdpa` (WRONG_KERNELS), each the
  correct dense NumPy kernel of `attncheck.testing.dense_sdpa` (CORRECT_KERNEL) with one bug;
  usable as `--impl attncheck.testing.wrong_kernels:NAME`.
- `attncheck.testing.strategies`: hypothesis strategies drawing valid configs from the whole
  option space, with large logits, or with long sequences. Needs hypothesis (the `test` extra).

Importing this package imports none of them, so neither torch nor hypothesis.
"""

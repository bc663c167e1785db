"""attncheck: prove that a multi-head attention implementation matches torch.nn.MultiheadAttention."""

__version__ = "0.1.0"

"""The encoder layer's suspected bugs (attncheck.suspects, for nn.TransformerEncoderLayer's
reference): its norms, residuals, feed-forward and activation computed as a student's slip does,
through the layer's hooks (attncheck.layer_reference.HOOKS)."""

from __future__ import annotations

import math

import numpy as np

from attncheck.config import Config
from attncheck.layer_reference import linear_forward
from attncheck.suspects import Suspect, _logits_scaled, batch_axis_words, other_scales


def _norms_swapped(base: type) -> dict:
    """The layer with norm1's parameters where norm2's go, and norm2's where norm1's go."""

    def _norm(self, i, x):
        return base._norm(self, 3 - i, x)

    return {"_norm": _norm}


def _eps_outside_the_root(base: type) -> dict:
    """Layer norm as (x - mean) / (sqrt(var) + eps) * w + b."""

    def _norm(self, i, x):
        centered = x - x.mean(axis=-1, keepdims=True)
        rstd = 1.0 / (np.sqrt((centered * centered).mean(axis=-1, keepdims=True)) + x.dtype.type(self.eps))
        y = centered * rstd * self._p(f"norm{i}.weight")
        bias = self._p(f"norm{i}.bias")
        return (y if bias is None else y + bias), None

    return {"_norm": _norm}


def _eps_of(base: type, eps: float) -> dict:
    """Layer norm with another eps: another framework's default."""

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self.eps = eps

    return {"__init__": __init__}


# Other frameworks' layer-norm eps defaults: Flax's nn.LayerNorm and Haiku's 1e-6, Keras's 1e-3.
OTHER_EPS = ((1e-6, "Flax's nn.LayerNorm default"), (1e-3, "Keras's LayerNormalization default"))


def _attention_scaled(base: type, factor: float) -> dict:
    """The layer with its self-attention's logits multiplied by `factor` (attncheck.suspects' scale
    suspects, on the layer's inner attention)."""

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        inner = type(self.attn)
        self.attn.__class__ = type(f"Scaled{inner.__name__}", (inner,), _logits_scaled(inner, factor))

    return {"__init__": __init__}


def _gelu_tanh(base: type) -> dict:
    """GELU as its tanh approximation: 0.5 z (1 + tanh(sqrt(2 / pi) (z + 0.044715 z^3)))."""

    def _ff(self, x, saved):
        z = linear_forward(x, self._p("linear1.weight"), self._p("linear1.bias"))
        r = 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
        return linear_forward(r, self._p("linear2.weight"), self._p("linear2.bias"))

    return {"_ff": _ff}


def _unbiased_variance(base: type) -> dict:
    """Layer norm with the squared deviations divided by E - 1 (torch.var's and np.var(ddof=1)'s)."""

    def _norm(self, i, x):
        centered = x - x.mean(axis=-1, keepdims=True)
        var = (centered * centered).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1)
        y = centered / np.sqrt(var + x.dtype.type(self.eps)) * self._p(f"norm{i}.weight")
        bias = self._p(f"norm{i}.bias")
        return (y if bias is None else y + bias), None

    return {"_norm": _norm}


def _residual_misplaced(norm_first: bool, blocks: tuple[int, ...] = (1, 2)) -> dict:
    """forward of a layer that takes its residual at the wrong point in `blocks` (1: attention, 2:
    feed-forward): post-norm as x + norm(f(x)) (the norm before the sum), pre-norm from the normed
    input, norm(x) + f(norm(x)); the other block as torch's."""

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        x, saved = np.asarray(src), {}
        f = {1: lambda y: self._sa(y, src_mask, src_key_padding_mask), 2: lambda y: self._ff(y, saved)}
        for i in (1, 2):
            if norm_first:
                n = self._norm(i, x)[0]
                x = (n if i in blocks else x) + f[i](n)
            else:
                x = x + self._norm(i, f[i](x))[0] if i in blocks else self._norm(i, x + f[i](x))[0]
        return self._stored(x)

    return {"forward": forward}


def _second_residual_from_input(norm_first: bool) -> dict:
    """forward of a layer whose second residual adds the layer's input src where torch adds the
    attention block's result h: post-norm norm2(src + f(h)) with h = norm1(src + sa(src)), pre-norm
    src + f(norm2(h)) with h = src + sa(norm1(src))."""

    def forward(self, src, *, src_mask=None, src_key_padding_mask=None, is_causal=False):
        x, saved = np.asarray(src), {}
        if norm_first:
            h = x + self._sa(self._norm(1, x)[0], src_mask, src_key_padding_mask)
            return self._stored(x + self._ff(self._norm(2, h)[0], saved))
        h = self._norm(1, x + self._sa(x, src_mask, src_key_padding_mask))[0]
        return self._stored(self._norm(2, x + self._ff(h, saved))[0])

    return {"forward": forward}


def _feed_forward_biases_dropped(base: type) -> dict:
    def _p(self, name):
        return None if name in ("linear1.bias", "linear2.bias") else base._p(self, name)

    return {"_p": _p}


def _activation_swapped(base: type, activation: str) -> dict:
    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **{**kwargs, "activation": activation})

    return {"__init__": __init__}


def _norm_placement_flipped(base: type) -> dict:
    """Pre-norm where post-norm is asked, or post-norm where pre-norm is."""

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self.norm_first = not self.norm_first

    return {"__init__": __init__}


def _layer_batch_first_read_as(base: type, batch_first: bool) -> dict:
    """__init__ of a layer whose attention reads src batch-first or not, whatever it is told (the
    layer's other steps act on the last axis alone)."""

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **{**kwargs, "batch_first": batch_first})

    return {"__init__": __init__}


def layer_suspects(base: type, cfg: Config) -> list[Suspect]:
    """A student's encoder-layer slips the layer's hooks can recompute (attncheck.layer_reference.HOOKS):
    the two norms' parameters swapped, eps outside the root, another framework's eps or the unbiased
    variance, the residual taken at the wrong point (in one block or both) or the second one from the
    layer's input, the feed-forward biases left out, the self-attention's logits scaled otherwise, the
    other activation or GELU's tanh approximation, the norms placed the other way. A new user's swapped norms read "everywhere: no
    head, row or column is spared", and a residual after the norm did until it was a suspect."""
    if not all(callable(getattr(base, name, None)) for name in ("_norm", "_ff", "_p", "_sa", "_stored")):
        return []
    placed = "pre-norm where post-norm (norm_first: false) is asked" if not cfg.norm_first else "post-norm where pre-norm (norm_first: true) is asked"
    suspects = [Suspect("norm1's and norm2's parameters swapped: the first layer norm computed with norm2's and the second with norm1's",
                        methods=_norms_swapped(base)),
                Suspect(f"layer norm with eps outside the root: (x - mean) / (sqrt(var) + eps), where torch has / sqrt(var + eps) (eps {cfg.layer_norm_eps:g})",
                        methods=_eps_outside_the_root(base)),
                Suspect("layer norm with the unbiased variance: the squared deviations divided by E - 1 (torch.var's default), "
                        "where LayerNorm divides by E", methods=_unbiased_variance(base)),
                *(Suspect(("the residual taken from the normed input: norm(x) + f(norm(x)), where torch's pre-norm layer has x + f(norm(x))"
                           if cfg.norm_first else
                           "the residual added after the norm: x + norm(f(x)), where torch's post-norm layer has norm(x + f(x))") + where,
                          methods=_residual_misplaced(cfg.norm_first, blocks))
                  for blocks, where in (((1, 2), ""), ((1,), ", in the attention block alone (norm1)"),
                                        ((2,), ", in the feed-forward block alone (norm2)"))),
                Suspect("the second residual adds the layer's input: src + ff(norm2(h)), where torch's pre-norm layer has "
                        "h + ff(norm2(h)), h = src + sa(norm1(src))"
                        if cfg.norm_first else
                        "the second residual adds the layer's input: norm2(src + ff(h)), where torch's post-norm layer has "
                        "norm2(h + ff(h)), h = norm1(src + sa(src))",
                        methods=_second_residual_from_input(cfg.norm_first)),
                Suspect(placed, methods=_norm_placement_flipped(base))]  # fmt: skip
    suspects += [Suspect(f"layer norm eps {eps:g} ({whose}) where the config's is {cfg.layer_norm_eps:g}", methods=_eps_of(base, eps))
                 for eps, whose in OTHER_EPS if eps != cfg.layer_norm_eps]  # fmt: skip
    if cfg.bias:
        suspects.append(Suspect("the feed-forward biases are not added (linear1.bias, linear2.bias)", methods=_feed_forward_biases_dropped(base)))
    suspects += [Suspect(f"in the self-attention, {words}", methods=_attention_scaled(base, factor)) for factor, words in other_scales(cfg)]
    other = "relu" if cfg.activation == "gelu" else "gelu"
    suspects.append(Suspect(f"activation {other} where {cfg.activation} is asked", methods=_activation_swapped(base, other)))
    if not cfg.unbatched and cfg.effective_batch > 1:
        suspects.append(Suspect(batch_axis_words(cfg, "src is"), methods=_layer_batch_first_read_as(base, not cfg.batch_first)))
    if cfg.activation == "gelu":
        suspects.append(Suspect("GELU computed as its tanh approximation, where torch's activation='gelu' is the exact erf one",
                                methods=_gelu_tanh(base)))  # fmt: skip
    return suspects

"""A constructor or forward that cannot take the calls attncheck makes is one contract error, exit
2, before any check runs (attncheck.contract); what signatures cannot tell is left to the checks."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attncheck.cli import app
from attncheck.config import config_from_mapping, load_config
from attncheck.contract import breach

runner = CliRunner()
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"

HEAD = "import numpy as np\n"
FORWARD = "    def forward(self, query, key, value, attn_mask=None, key_padding_mask=None, need_weights=True, average_attn_weights=True):\n        return query, None\n"
INIT = "    def __init__(self, params, num_heads, batch_first, **options):\n        self.params = params\n"

# (name, the class's body, the words the error must have; "" when the contract holds)
CASES = [
    ("constructor-missing", "    def __init__(self, params, n_heads):\n        pass\n" + FORWARD,
     "MHA(params, num_heads=2, batch_first=True"),
    ("constructor-no-kdim", "    def __init__(self, params, num_heads, batch_first, embed_dim, bias, dropout):\n        pass\n" + FORWARD,
     "unexpected keyword argument 'kdim'"),
    ("forward-own-names", INIT + "    def forward(self, x, mask=None):\n        return x, None\n",
     "MHA(...).forward(query, key, value, attn_mask=None"),
    ("forward-no-average", INIT + "    def forward(self, query, key, value, attn_mask=None, key_padding_mask=None, need_weights=True):\n        return query, None\n",
     "unexpected keyword argument 'average_attn_weights'"),
    ("holds", INIT + FORWARD, ""),
    ("holds-with-kwargs", "    def __init__(self, *args, **kwargs):\n        pass\n    def forward(self, *args, **kwargs):\n        return args[0], None\n", ""),
    ("holds-staticmethod", INIT + "    @staticmethod\n    def forward(query, key, value, **kw):\n        return query, None\n", ""),
]


def candidate(tmp_path, body: str) -> str:
    path = tmp_path / "mine.py"
    path.write_text(HEAD + "class MHA:\n" + body)
    return f"{path}:MHA"


@pytest.mark.parametrize("name,body,words", CASES, ids=[c[0] for c in CASES])
def test_the_contract_is_checked_before_any_check(tmp_path, name, body, words):
    # The contract is checked once per candidate and module kind, before any check, on the first
    # case's config: where it holds, one config's checks show that they run (the default suite's
    # 41 forward checks of a candidate that fails them all took 0.7 s more and showed nothing else).
    config = [] if words else ["-c", str(CONFIG)]
    result = runner.invoke(app, ["forward", "--impl", candidate(tmp_path, body), *config])
    if not words:
        assert result.exit_code == 1, result.output  # the contract holds: the checks run (and fail: it returns its query)
        assert "does not fit the contract" not in result.output
        return
    assert result.exit_code == 2, result.output
    assert "does not fit the contract of `module: multihead_attention` (no check was run)" in result.output
    assert words in result.output and "but its signature is" in result.output
    assert "summary" not in result.output and "FAIL" not in result.output
    assert result.output.count("error:") == 4  # one error, four lines: what, the call, the signature, the way out


def test_a_config_file_places_the_error_at_its_impl(tmp_path):
    spec = candidate(tmp_path, CASES[0][1])
    config = tmp_path / "c.yaml"
    config.write_text(f"impl: {spec.rsplit('/', 1)[1]}\n")
    result = runner.invoke(app, ["forward", "-c", str(config)])
    assert result.exit_code == 2 and f"{config}:1: impl" in result.output, result.output


def test_a_kernel_without_a_flash_attention_keyword_is_left_to_the_checks():
    def kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return query

    assert breach(config_from_mapping({"module": "sdpa", "window_size": [2, 0]}), kernel) == ""
    assert "unexpected keyword argument 'dropout_p'" in breach(config_from_mapping({"module": "sdpa"}), lambda query, key, value, attn_mask=None: query)


def test_a_kernel_checked_without_module_is_pointed_to_the_function_kinds():
    # A new kernel writer's first command leaves out --module: the error showed SDPA's own signature
    # and never said which module kind takes it.
    def my_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return query

    why = breach(load_config(None), my_attention)
    assert why.endswith("Its first parameters are an attention function's (query, key, value): check it as one, with "
                        "`--module sdpa` (`module:` in a config)."), why  # fmt: skip
    # The kernel class of the docs and examples (built with no arguments, called through forward) too,
    # and each kind named only where its call fits: the varlen and decode kernels are not SDPA's.
    from attncheck.testing.wrong_varlen import DenseVarlen

    class Kernel:
        def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            return query

    assert breach(load_config(None), Kernel).endswith("with `--module sdpa` (`module:` in a config)."), breach(load_config(None), Kernel)
    assert breach(load_config(None), DenseVarlen).endswith("(q, k, v): check it as one, with `--module sdpa_varlen` (`module:` in a config).")

    def decode(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
               cache_leftpad=None, block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
        return q

    assert breach(load_config(None), decode).endswith("with `--module sdpa_kvcache` (`module:` in a config)."), breach(load_config(None), decode)
    # (q, k, v) whose call no function kind's fits (flash_attn_func's keywords): every function kind is named
    assert breach(load_config(None), lambda q, k, v, dropout_p=0.0, softmax_scale=None, causal=False: q).endswith(
        "`--module sdpa`, `--module sdpa_varlen` or `--module sdpa_kvcache` (`module:` in a config).")

    class TakesArrays:  # a class built from (query, key, value) is no kernel of the contract: no hint
        def __init__(self, query, key, value):
            pass

    assert "attention function" not in breach(load_config(None), TakesArrays)
    assert "attention function" not in breach(load_config(None), lambda params, n_heads: object())  # a factory, wrongly built: no hint


def test_signatures_that_do_not_say_are_left_to_the_checks():
    cfg = load_config(None)
    assert breach(cfg, dict) == ""  # a builtin: no signature to read
    assert breach(cfg, lambda params, **kw: object()) == ""  # a factory function: its object's forward is unknown
    assert "missing a required argument" in breach(cfg, lambda params, n_heads: object())


def test_the_encoder_layer_contract():
    cfg = config_from_mapping({"module": "transformer_encoder_layer"})

    class Layer:
        def __init__(self, params, **options):
            pass

        def forward(self, src, src_mask=None, src_key_padding_mask=None):
            return src

    assert "unexpected keyword argument 'is_causal'" in breach(cfg, Layer)


def test_a_forward_set_on_the_object_is_left_to_the_checks(tmp_path):
    """An nn.Module that picks its forward in __init__ (torch.compile, say): the class has only
    nn.Module's stub, which takes no keywords; the object's own forward is known once built."""
    path = tmp_path / "picked.py"
    path.write_text(textwrap.dedent("""\
        import torch
        from attncheck.reference import MultiheadAttention as Reference


        class Picked(torch.nn.Module):
            def __init__(self, params, **options):
                super().__init__()
                self.impl = Reference({k: v.detach().numpy() for k, v in params.items()}, **options)
                self.forward = self.run

            def run(self, query, key, value, **kw):
                out, w = self.impl.forward(query.detach().numpy(), key.detach().numpy(), value.detach().numpy(), **kw)
                return torch.as_tensor(out), None if w is None else torch.as_tensor(w)
        """))
    result = runner.invoke(app, ["forward", "--impl", f"{path}:Picked", "-c", "configs/default.yaml"])
    assert "does not fit the contract" not in result.output, result.output


def test_a_module_checked_as_a_kernel_is_pointed_to_the_module_kinds():
    # A new user's NumPy MHA class under --module sdpa: "attncheck builds it as NumpyMHA()" and no
    # word of the module kinds, where the reverse mistake (a kernel without --module) gets one.
    class MHA:
        def __init__(self, params, *, num_heads, batch_first, embed_dim=None, kdim=None, vdim=None, bias=True, add_bias_kv=False,
                     add_zero_attn=False, dropout=0.0):  # fmt: skip
            pass

    why = breach(config_from_mapping({"module": "sdpa"}), MHA)
    assert why.startswith("attncheck builds it as ") and ".MHA()\nbut its signature is " in why
    assert why.endswith("It is built from parameters, as a module is: check it as one, with `--module multihead_attention` "
                        "(the default, so no `--module sdpa`); in a config, with `module:`."), why  # fmt: skip
    assert "as a module is" not in breach(config_from_mapping({"module": "sdpa"}), lambda query, key, value, attn_mask=None: query)

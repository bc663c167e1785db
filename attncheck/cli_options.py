"""The command line's options, shared by its commands: each a typed annotation with its flag and help
(typer reads them), and the enums of their allowed values."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Optional

import typer

class Module(str, enum.Enum):
    multihead_attention = "multihead_attention"
    transformer_encoder_layer = "transformer_encoder_layer"
    sdpa = "sdpa"
    sdpa_varlen = "sdpa_varlen"
    sdpa_kvcache = "sdpa_kvcache"


class Tolerance(str, enum.Enum):
    budget = "budget"
    fixed = "fixed"


ConfigOption = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", help="YAML config or suite file; the embedded default suite (a case per feature) when omitted.", show_default=False),
]
JsonOption = Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON to this path.", show_default=False)]
ImplOption = Annotated[
    Optional[str],
    typer.Option(
        "--impl",
        help="The implementation to check: 'package.module:attr' or 'path/to/file.py:attr'. "
        "Default: the config's `impl`, else attncheck.reference:MultiheadAttention.",
        show_default=False,
    ),
]
ToleranceOption = Annotated[
    Optional[Tolerance],
    typer.Option("--tolerance", help="budget: judged against torch's own error from a float64 oracle; fixed: atol/rtol table. Overrides the config.", show_default=False),
]


class Framework(str, enum.Enum):
    numpy = "numpy"
    torch = "torch"
    jax = "jax"


class Device(str, enum.Enum):
    cpu = "cpu"
    cuda = "cuda"


FrameworkOption = Annotated[
    Optional[Framework],
    typer.Option("--framework", help="The candidate's array library; default: the config's `framework`, else detected "
                 "(an nn.Module, or a module importing torch or jax without NumPy).", show_default=False),
]  # fmt: skip
DeviceOption = Annotated[
    Optional[Device],
    typer.Option("--device", help="Where torch and a torch candidate run (cuda: exit 2 without a GPU). Overrides the config.", show_default=False),
]


JunitOption = Annotated[Optional[Path], typer.Option("--junit", help="Also write JUnit XML (one testcase per case x command) to this path.", show_default=False)]
ShardOption = Annotated[
    Optional[str],
    typer.Option("--shard", help="Run shard I of N (1-based, e.g. 2/4): the cases whose index is I-1 modulo N.", show_default=False),
]
CaseOption = Annotated[
    Optional[list[str]],
    typer.Option("--case", help="Run only these cases of the suite (names as the summary lists them, comma-separated or the option repeated; "
                 "e.g. --case float16-long to look at one default-suite case in full).", show_default=False),
]
WorkersOption = Annotated[
    int,
    typer.Option("--workers", min=1, help="Run cases in this many local processes. Each first imports torch (1-8 s measured), so "
                 "workers pay off only on idle cores and when each worker's checks take well longer than "
                 "that: long sequences, many grad/sgd-step cases; not the 128-case option grid (2x slower with 2)."),
]  # fmt: skip
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="Suites: full tables for every check and a summary row for every check, not only failing ones.")]
PlotOption = Annotated[
    Optional[Path],
    typer.Option("--plot", help="Draw |candidate - reference| / allowed for each failing quantity: PATH.png or PATH.svg "
                 "(one file per quantity, PATH itself when there is one), PATH.pdf (one page per quantity), "
                 "or a directory (PNG files). Needs matplotlib (pip install matplotlib).", show_default=False),
]  # fmt: skip
PlotAllOption = Annotated[bool, typer.Option("--plot-all", help="With --plot: draw every compared quantity, not only failing ones.")]
ModuleOption = Annotated[
    Optional[Module],
    typer.Option("--module", help="What to check against: multihead_attention, transformer_encoder_layer, sdpa (the attention function "
                 "itself, F.scaled_dot_product_attention's signature), sdpa_varlen (packed sequences, flash_attn_varlen_func's) "
                 "or sdpa_kvcache (a decode kernel, flash_attn_with_kvcache's). "
                 "Without --config, the embedded default suite of that module runs; with one, every case must check it.",
                 show_default=False),
]  # fmt: skip
TimeoutOption = Annotated[
    Optional[float],
    typer.Option("--timeout", help="Seconds one call into the candidate may take before its process is killed and the call fails. "
                 "Default: the config's `timeout`, else 60 s plus 1 s per million attention logits.", show_default=False),
]  # fmt: skip
SetOption = Annotated[
    Optional[list[str]],
    typer.Option("--set", metavar="KEY=VALUE", help="Set a config key in every case (repeatable), validated as in a config file; "
                 "VALUE is read as YAML (false, 0.5, causal, null). E.g. --set check_dtype=false --set attn_mask=causal.",
                 show_default=False),
]  # fmt: skip
TracebackOption = Annotated[bool, typer.Option("--traceback", help="Show the candidate's full traceback when a call into it raised.")]
PerHeadOption = Annotated[bool, typer.Option("--per-head", help="grad: add one row per head for the projection blocks.")]
StrictOption = Annotated[bool, typer.Option("--strict", help="Count gradients (grad) and attention weights (forward) the candidate does not return as failures.")]
PairsOption = Annotated[
    bool,
    typer.Option("--pairs", help="Instead of the default suite, every two of its cases merged into one where their options fit "
                 "(a mask with GQA, the LSE with a window, ALiBi with a scale...): the bugs that need two options together, "
                 "which a case per option misses: 40 to 793 pairs by module, 1-40 s for the reference. --case takes a pair "
                 "(window-4-0+scale, either order) or a default case's name (every pair it is in). Not with --config.")]  # fmt: skip

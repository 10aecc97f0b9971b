"""Code for the scripts that tests run in a fresh Python (the start-up hook, an installed wheel,
a launcher's ranks). Imports nothing of cce_compile: some of those scripts must not."""

from __future__ import annotations

# Every Inductor compile of the script runs as Inductor does up to its code generation (the
# pre-grad hook where CCE_COMPILE=1 puts the pass, the backend "cce", decompositions,
# AOTAutograd), then its forward and backward graphs run as FX code: what tests/harness.py's
# inductor_without_codegen() does in-process. For scripts that test how the pass gets installed,
# not Inductor's C++ for the op (tests/op, test_backend.py build it): a tiny loss compiles in
# ~3 s of CPU instead of ~15 s with a cold cache. There is no generated code to cache.
INDUCTOR_WITHOUT_CODEGEN = """
import torch._functorch.config, torch._inductor.config
from torch._functorch.aot_autograd import make_boxed_func as _boxed
from torch._inductor import compile_fx as _compile_fx_module

_real_compile_fx = _compile_fx_module.compile_fx


def _compile_fx_without_codegen(*args, **kwargs):
    kwargs.setdefault("inner_compile", lambda gm, example_inputs, **_: _boxed(gm.forward))
    return _real_compile_fx(*args, **kwargs)


_compile_fx_module.compile_fx = _compile_fx_without_codegen
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
"""


def install_inductor_without_codegen() -> None:
    """INDUCTOR_WITHOUT_CODEGEN, in this process: for a script file that imports this module."""
    exec(INDUCTOR_WITHOUT_CODEGEN, {})

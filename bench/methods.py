"""The loss methods bench/bench.py times: torch (eager, compiled, with cce_compile's pass),
cce_compile's op in its modes and under other settings, and its peers (Apple's CCE, Liger,
TRL's fused head, quack).

``method_factories()`` maps each name to a factory that returns
``callable(hidden, classifier, targets) -> loss``; a factory imports what its method needs
when it is called, so that a peer that is not installed fails only its own method.
"""

from __future__ import annotations

import pathlib
from unittest import mock

import torch
import torch.nn.functional as F


def count_first_selection(valid: torch.Tensor, order_of=None):
    """Fast mode's compaction as before bdc59b7: the count of kept rows waited for
    (``nonzero``) before the first GEMM, not after it (``compaction._kept_first``'s order;
    ``order_of``, the implementation's kept-first kernel, is not used)."""
    from cce_compile.op import compaction

    return compaction.Selection(valid.nonzero().squeeze(1), valid.numel())


def eager_loss(hidden, classifier, targets):
    logits = hidden @ classifier.T
    return F.cross_entropy(logits.float(), targets, ignore_index=-100)


def _cce_patched_methods():
    """The default with some of cce_compile's names replaced for the call: the forms it had
    before a change, and skipping ignored rows whatever the size."""
    import cce_compile

    def auto_patched(module, **values):
        """The default with some of ``module``'s names replaced for the call (a function by a
        function, a constant by a constant)."""

        def loss(h, c, t):
            with mock.patch.multiple(module, **values):
                return cce_compile.linear_cross_entropy(h, c, t)

        return loss

    def auto_with_policy(**values):
        """The default with some of ``policy``'s names replaced for the call."""
        from cce_compile import policy

        return auto_patched(policy, **values)

    def auto_count_first():
        from cce_compile.op import compaction

        return auto_patched(compaction, _kept_first=count_first_selection)

    return {
        # skipping ignored rows whatever the size
        "cce_auto_skip_any_size": lambda: auto_with_policy(MIN_SKIP_MACS=0),
        # the count of kept rows waited for before the first GEMM: compaction before bdc59b7
        "cce_auto_count_first": auto_count_first,
        # a frozen head's chunks on the whole budget: the frozen default before 4c7e74e
        "cce_auto_frozen_whole_budget": lambda: auto_with_policy(FROZEN_BUDGET_SHARE=1.0),
        # fast mode's chunks as whole float32 rows (cuBLAS logits, then chunk_softmax_grad), not
        # the GEMM's scaled exponentials: the whole-row form before the fused GEMM (05c7832)
        "cce_auto_whole_rows": lambda: auto_with_policy(fast_fuses_exp=lambda *a, **k: False),
    }


def _cce_budget_methods():
    """The default under other memory budgets: fixed ones, and the smallest that admits fast
    mode with chunks of a given number of rows."""
    import cce_compile

    methods = {}

    def auto_with_budget(h, c, t, megabytes):
        """The default under CCE_MEMORY_BUDGET_MB=megabytes (fewer, larger chunks and slabs on
        small problems, where the default's 1/5 of the logits is a few tens of MB)."""
        with cce_compile.config.override(memory_budget_mb=megabytes):
            return cce_compile.linear_cross_entropy(h, c, t)

    for megabytes in (128, 256, 512):
        methods[f"cce_auto_budget{megabytes}"] = lambda mb=megabytes: (
            lambda h, c, t: auto_with_budget(h, c, t, mb)
        )

    def auto_with_fast_rows(h, c, t, chunk_rows):
        """auto under the smallest budget that admits fast mode with ``chunk_rows``-row chunks
        of whole float32 rows (float32 logits and d hidden per row, and the rounded hidden under
        AMP): a point on fast mode's memory/speed curve (policy.py). Where the policy takes
        the fused form (bf16 scaled exponentials) the same budget holds more rows."""
        vocab, dim = c.shape
        rows = h.numel() // dim
        rounded = rows * dim * 2 if torch.is_autocast_enabled("cuda") else 0
        budget = chunk_rows * (vocab + dim) * 4 + rounded
        with cce_compile.config.override(memory_budget_mb=budget // 2**20 + 1):
            return cce_compile.linear_cross_entropy(h, c, t)

    for chunk_rows in (512, 1024, 2048, 4096):
        methods[f"cce_fast_rows{chunk_rows}"] = lambda n=chunk_rows: (
            lambda h, c, t: auto_with_fast_rows(h, c, t, n)
        )

    return methods


def _cce_methods():
    """cce_compile's modes and the default under other settings (budgets, chunk forms, skipping)."""
    import cce_compile

    methods = {}
    for mode in ("lean", "fast", "auto"):
        methods[f"cce_{mode}"] = lambda mode=mode: (
            lambda h, c, t: cce_compile.linear_cross_entropy(h, c, t, mode=mode)
        )

    def auto_every_row(h, c, t):
        """The default with CCE_SKIP_IGNORED=0: ignored rows computed, no host sync."""
        with cce_compile.config.override(skip_ignored=False):
            return cce_compile.linear_cross_entropy(h, c, t)

    methods["cce_auto_every_row"] = lambda: auto_every_row
    methods.update(_cce_patched_methods())
    methods.update(_cce_budget_methods())
    return methods


def _trl_chunk_size() -> int:
    """TRL's chunk size for its fused head (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``).
    That module imports ``datasets``, which the GPU machine lacks; its kernel does not, so
    there the constant is read from the module's source instead of importing it."""
    try:
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        return _CHUNKED_LOGPROB_CHUNK_SIZE
    except ImportError:
        import re

        import trl

        source = (pathlib.Path(trl.__file__).parent / "trainer" / "utils.py").read_text()
        return int(re.search(r"^_CHUNKED_LOGPROB_CHUNK_SIZE\s*=\s*(\d+)", source, re.M)[1])


def _peer_methods():
    """Apple's CCE, Liger, TRL's fused head and quack, each imported when its method runs."""
    methods = {}

    def apple(filter_eps):
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, c, t: linear_cross_entropy(h, c, t, filter_eps=filter_eps)

    methods["apple_cce"] = lambda: apple("high")
    methods["apple_cce_exact"] = lambda: apple(None)

    def liger():
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

        loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        return lambda h, c, t: loss_fn(c, h, t)

    methods["liger"] = liger

    def trl_fused_head():
        # As SFTTrainer calls it (trl.trainer.utils.add_fused_lm_head, TRL 1.16): the valid
        # positions only, its chunk size, the outputs its metrics log; the loss is its mean.
        from trl.kernels import ChunkedLogProbFunction

        chunk_size = _trl_chunk_size()

        def loss_fn(h, c, t):
            mask = t != -100
            log_probs, *_ = ChunkedLogProbFunction.apply(
                h[mask],
                c,
                None,
                t[mask],
                1.0,
                chunk_size,
                None,
                1.0,
                ("log_probs", "entropy", "is_top1"),
            )
            return -log_probs.sum() / mask.sum().clamp(min=1)

        return loss_fn

    methods["trl_fused_head"] = trl_fused_head

    def quack():
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        return lambda h, c, t: chunked_linear_cross_entropy(h, c, t)

    methods["quack"] = quack
    return methods


def _cce_backend():
    import cce_compile

    return cce_compile.backend


def method_factories():
    """name -> (callable(hidden, classifier, targets) -> loss, or None when unavailable)."""

    methods = {}
    methods["torch_eager"] = lambda: eager_loss
    methods["torch_compile"] = lambda: torch.compile(eager_loss, dynamic=False)

    def autochunk():
        compiled = torch.compile(eager_loss, dynamic=False, options={"auto_chunker.enable": True})
        return compiled

    methods["compile_autochunk"] = autochunk
    # The pass through torch.compile, and both under CUDA graphs: the host-bound small heads' case.
    methods["torch_compile_graphs"] = lambda: torch.compile(
        eager_loss, dynamic=False, mode="reduce-overhead"
    )
    # The backend object, not its entry-point name: a source tree on PYTHONPATH registers none.
    methods["cce_pass"] = lambda: torch.compile(eager_loss, backend=_cce_backend(), dynamic=False)
    methods["cce_pass_graphs"] = lambda: torch.compile(
        eager_loss, backend=_cce_backend(), dynamic=False, mode="reduce-overhead"
    )
    methods.update(_cce_methods())
    methods.update(_peer_methods())
    if hasattr(F, "linear_cross_entropy"):
        methods["torch_linear_cross_entropy"] = lambda: (
            lambda h, c, t: F.linear_cross_entropy(h, c, t)
        )
    return methods

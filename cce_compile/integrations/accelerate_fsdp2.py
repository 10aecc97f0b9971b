"""accelerate's FSDP2 with the pass: the output head stays in the root FSDP2 unit, so the head
and the loss meet in one graph.

accelerate 1.15's ``fsdp2_prepare_model`` carves ``[final norm, lm_head]`` into a unit of their
own (``fully_shard([norm, lm_head], reshard_after_forward=False)``; with tied embeddings the
input embedding joins them). FSDP2's hooks are ``torch._dynamo.disable``d, so Dynamo breaks the
graph at the head's call: the head runs eagerly, materialises the logits, and the loss's graph
receives them as an input (``logits_from_graph_input``). With the head in the root unit (whose
hooks wrap the whole compiled model, outside its graph) the head is a plain gathered weight
inside the compiled forward, and the pass fuses it with the loss.

``install()`` wraps ``accelerate.accelerator.fsdp2_prepare_model`` (the name ``Accelerator.
prepare`` calls; at once if accelerate is imported, else when it is). The wrapper changes
nothing unless the pass is on Inductor's hook (``cce_compile.enable()``, which calls
``install()``; the ``CCE_COMPILE=1`` start-up hook does so at the first ``torch.compile``, which
accelerate runs just before it shards the model) and the model it prepares is compiled (the
Trainer's ``torch_compile=True``). Then, while accelerate shards it, the model's
``get_output_embeddings`` (and, when tied, ``get_input_embeddings``) answer None, so accelerate
carves only the final norm; the head's weight joins the root unit. The sharding, the
collectives' sizes and every value computed are those of accelerate's layout.

Cost, per rank: the root unit gathers the head's weight (V x D, parameter dtype) at the start
of the forward instead of at the final norm, and frees it and its unsharded gradient (V x D)
at the end of the backward instead of right after the head's backward; the gradient's
reduce-scatter then runs at the end of the backward, after the blocks'. With tied embeddings
nothing changes: accelerate's unit already held that weight from the embedding's forward to
the end of the backward.

This module imports neither torch nor accelerate until it is used.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Iterator
from typing import Any

from .. import import_hooks

log = logging.getLogger("cce_compile")

_MODULE = "accelerate.accelerator"
_GLOBAL = "fsdp2_prepare_model"
_MARK = "_cce_keeps_the_head_in_the_root_unit"
_OUTPUT, _INPUT = "get_output_embeddings", "get_input_embeddings"

# How many models were prepared with their head in the root unit (tests and reports read it).
kept_in_root = 0


def install() -> None:
    """Wrap accelerate's FSDP2 preparation (now, or when ``accelerate.accelerator`` is
    imported); idempotent. Imports nothing itself."""
    import_hooks.after_import(_MODULE, _wrap)


def uninstall() -> None:
    """accelerate's own ``fsdp2_prepare_model`` again (its ``[norm, lm_head]`` unit)."""
    import_hooks.cancel(_MODULE, _wrap)
    module = sys.modules.get(_MODULE)
    prepare = getattr(module, _GLOBAL, None)
    if getattr(prepare, _MARK, False):
        setattr(module, _GLOBAL, prepare.__wrapped__)


def installed() -> bool:
    return getattr(getattr(sys.modules.get(_MODULE), _GLOBAL, None), _MARK, False)


def _wrap(module: Any) -> None:
    prepare = getattr(module, _GLOBAL, None)
    if prepare is None or getattr(prepare, _MARK, False):
        return

    @functools.wraps(prepare)
    def fsdp2_prepare_model(accelerator, model, *args, **kwargs):
        with _head_in_root_unit(model) as tied:
            prepared = prepare(accelerator, model, *args, **kwargs)
        if tied:
            _check_still_tied(prepared)
        return prepared

    setattr(fsdp2_prepare_model, _MARK, True)
    setattr(module, _GLOBAL, fsdp2_prepare_model)


@contextlib.contextmanager
def _head_in_root_unit(model: Any) -> Iterator[bool | None]:
    """While accelerate shards ``model``, its embedding getters that would put the head in a
    unit of its own answer None. Yields None when nothing is hidden, else whether the head's
    weight is tied to the input embedding's."""
    hidden = _getters_to_hide(model)
    if not hidden:
        yield None
        return
    originals = {name: getattr(model, name) for name in hidden}
    for name in hidden:
        setattr(model, name, _no_module)
    try:
        yield len(hidden) == 2
    finally:
        for name, original in originals.items():
            delattr(model, name)  # the class's method again
            if getattr(model, name, None) != original:  # it was the instance's own
                setattr(model, name, original)
    global kept_in_root
    kept_in_root += 1
    log.info(
        "cce_compile: accelerate's FSDP2 keeps %s in the root unit (a unit of its own would "
        "break the graph between the head and the loss, leaving the loss unfused); the head's "
        "gathered weight and gradient live until the end of the backward",
        "the tied lm_head and input embedding" if len(hidden) == 2 else "lm_head",
    )


def _no_module() -> None:
    return None


def _getters_to_hide(model: Any) -> list[str]:
    """The getters to hide from accelerate: none unless the pass is on Inductor's hook and
    the model is compiled (its head and loss in one compiled forward) with an unsharded
    head."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.distributed.fsdp import FSDPModule

    from ..passes.install import enabled

    if not enabled() or not isinstance(model, OptimizedModule) or isinstance(model, FSDPModule):
        return []
    head = _call(model, _OUTPUT)
    weight = getattr(head, "weight", None)
    if weight is None or isinstance(head, FSDPModule):
        return []
    embedding = _call(model, _INPUT)
    if getattr(embedding, "weight", None) is weight:
        return [_OUTPUT, _INPUT]  # one weight: both stay in the root, as torch >= 2.13 requires
    return [_OUTPUT]


def _call(model: Any, name: str) -> Any:
    getter = getattr(model, name, None)
    return getter() if callable(getter) else None


def _check_still_tied(model: Any) -> None:
    """accelerate re-ties the embeddings of a model it loaded on ``meta``; a transformers
    whose ``tie_weights`` reads the hidden getters would not have."""
    head, embedding = _call(model, _OUTPUT), _call(model, _INPUT)
    if getattr(head, "weight", None) is not getattr(embedding, "weight", None):
        raise RuntimeError(
            "cce_compile: the tied lm_head and input embedding came out of accelerate's FSDP2 "
            "preparation untied; call cce_compile.integrations.accelerate_fsdp2.uninstall() "
            "before accelerator.prepare to keep accelerate's own layout"
        )

"""cce_compile's fused loss in torchtitan's own trainer, through torchtitan's documented hooks.

One module for the two torchtitan lines; importing it checks the installed version.

**torchtitan 0.2.x** (0.2.2: the release for torch 2.11) computes ``loss_fn(model(inputs),
labels)``: the model applies its head ``output``, the loss gets the (B, T, V) logits. The
extension point for both is a ``TrainSpec``, loaded with ``--experimental.custom_import``.
Importing this module registers ``llama3_cce``: torchtitan's own ``llama3`` spec with

* a model whose ``output`` is a ``FusedHead``: an ``nn.Linear`` (same parameter, FQN,
  initialisation, FSDP unit ``[norm, output]`` and tensor-parallel plan) that returns the
  hidden states it is given instead of logits. It is still called where the model calls it, so
  FSDP2's and the TP plan's hooks on it run as usual;
* a loss that is ``cce_compile.linear_cross_entropy(hidden, output.weight, labels,
  reduction='sum')`` (torchtitan's own loss is a sum, divided by the global token count by the
  trainer): no logits exist. FSDP2 keeps the ``[norm, output]`` unit unsharded from its forward
  to its backward (torchtitan reshards it after forward only with
  ``fsdp_reshard_after_forward='always'``, refused), so the loss reads the gathered weight.
  Under tensor parallelism the weight is vocabulary-sharded and the loss is
  ``cce_compile.distributed.vocab_parallel_cross_entropy`` of the head's own (sequence-sharded)
  input, the model returning an empty stand-in: the head's collectives are those of
  torchtitan's head (``FusedHead``).

Two flags::

    torchrun --nproc-per-node 2 -m torchtitan.train --job.config_file <your.toml> \\
        --experimental.custom_import cce_compile.integrations.torchtitan --model.name llama3_cce

Other models whose head is ``output`` (an ``nn.Linear``) can be registered from your own
custom import: ``register("qwen3")`` gives ``qwen3_cce`` (only llama3 is tested). Pipeline
parallelism is refused.

**torchtitan 0.3.x** (needs torch >= 2.12) has the hook itself: a loss that is a
``ChunkedLossWrapper`` is handed the model's ``lm_head`` and the model returns its hidden
states. The override ``cce_loss`` replaces torchtitan's cross-entropy loss config with
``FusedLoss``, such a wrapper computing the same sum with the op, called through the head
module so that FSDP2's hooks on it run (the ``[norm, lm_head]`` unit is gathered again when
it was resharded after the norm's forward). One flag::

    ... --override.imports cce_compile.integrations.torchtitan.cce_loss

Tensor parallelism is refused there (the head's TP hooks would treat the loss as logits).
docs/torchtitan.md.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

import torch
from torch import nn

from ..functional import linear_cross_entropy

log = logging.getLogger("cce_compile")

SUPPORTED_TORCHTITAN = ((0, 2), (0, 3))  # major.minor releases this module was written for


class TorchtitanIntegrationError(RuntimeError):
    """torchtitan, or its configuration, is not one this integration can serve."""


def check_torchtitan_version(version: str) -> tuple[int, int]:
    """(major, minor) of ``version`` if this module supports it; raises otherwise."""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        found = None
    if found not in SUPPORTED_TORCHTITAN:
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_TORCHTITAN)
        raise TorchtitanIntegrationError(
            f"cce_compile.integrations.torchtitan supports torchtitan {supported}; installed "
            f"torchtitan {version}. Run torchtitan without cce_compile's hook (no "
            "--experimental.custom_import / --override.imports cce_compile.integrations."
            "torchtitan...), or install torchtitan==0.2.2 (0.3.0 with torch >= 2.12)."
        )
    return found


class FusedHead(nn.Linear):
    """The model's ``output`` for the fused loss: hands its input (the normed hidden states)
    through; the loss applies the weight. Being called keeps FSDP2's and TP's hooks in place.

    Under tensor parallelism the input is a DTensor (torchtitan 0.2's plan: ``Shard(1)``, the
    final norm's sequence-parallel output), and the head's plan would gather it to
    ``Replicate`` before ``forward`` and then place what ``forward`` returns as logits: split
    over D under loss parallelism (which the loss would gather back), or made local (whose
    gradient then comes back all-reduced). Instead the hooks are given an empty replicated
    stand-in (no communication), the call returns what they make of it, and the loss takes the
    input itself (``tp_input``): the op gathers it once and its backward reduce-scatters
    hidden's gradient, torchtitan's own head's collectives. Nothing flows back through the
    returned stand-in, so FSDP2's pre-backward hook on it does not run (its prefetch of the
    last block's weights is lost); FSDP2 still reduces this unit's gradients when hidden's
    gradient reaches the norm.
    """

    # (what the latest call returned, the DTensor it was given): set under TP only
    _tp_handover: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        if not isinstance(hidden, DTensor):
            self._tp_handover = None
            return super().__call__(hidden)  # FSDP2's hooks run in here
        mesh = hidden.device_mesh
        empty = hidden.to_local().detach()[..., :0, :]  # (..., 0 tokens, D)
        stand_in = DTensor.from_local(empty, mesh, [Replicate()] * mesh.ndim, run_check=False)
        returned = super().__call__(stand_in)  # FSDP2's hooks and the TP plan's, no comm
        self._tp_handover = (returned, hidden)
        return returned

    def tp_input(self, returned: torch.Tensor) -> torch.Tensor | None:
        """The DTensor the latest call was given if ``returned`` is what that call returned
        (the loss's ``pred``), else None. Each call's is handed over once."""
        handover, self._tp_handover = self._tp_handover, None
        if handover is None or handover[0] is not returned:
            return None
        return handover[1]


# The FusedHead of each model built: torchtitan builds the loss apart from the model
# (``build_loss_fn(job_config, parallel_dims=...)``), so the loss finds the head here.
_heads: list[weakref.ref] = []


def _fused_model_class(base: type) -> type:
    """``base`` (a torchtitan model class) whose ``output`` is a FusedHead."""

    def __init__(self, model_args):
        base.__init__(self, model_args)
        head = getattr(self, "output", None)
        if type(head) is not nn.Linear:
            raise TorchtitanIntegrationError(
                f"{base.__qualname__}.output is {type(head).__name__}, not an nn.Linear: the "
                "fused loss replaces a linear lm_head named 'output'"
            )
        fused = FusedHead(
            head.in_features,
            head.out_features,
            bias=head.bias is not None,
            device=head.weight.device,
            dtype=head.weight.dtype,
        )
        self.output = fused
        _heads.append(weakref.ref(fused))

    return type(f"Fused{base.__name__}", (base,), {"__init__": __init__})


def _model_head() -> FusedHead:
    live = [head for head in (ref() for ref in _heads) if head is not None]
    if len(live) != 1:
        raise TorchtitanIntegrationError(
            f"cce_compile's torchtitan loss expects one model with a FusedHead, found {len(live)}"
        )
    return live[0]


def fused_cross_entropy(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor):
    """Sum over the non-ignored tokens (-100) of CE(head(hidden), labels), without logits.

    hidden (B, T, D), labels (B, T). A plain head weight (V, D) (single device, FSDP2 after
    its all-gather) takes the op; a tensor-parallel one, ``Shard(0)`` on the tp mesh, takes the
    vocabulary-parallel op, which returns the loss replicated; a DTensor hidden's gradient is
    left ``Partial`` for DTensor to reduce once.
    """
    from torch.distributed.tensor import DTensor, Shard

    weight, bias = head.weight, head.bias
    if not isinstance(weight, DTensor):
        return linear_cross_entropy(hidden, weight, labels, bias, reduction="sum")
    if tuple(weight.placements) != (Shard(0),):
        raise TorchtitanIntegrationError(
            f"the head's weight is placed {weight.placements} on {weight.device_mesh}; the "
            "fused loss needs it unsharded by FSDP and Shard(0) (vocabulary) on the tp mesh"
        )
    from ..distributed import vocab_parallel_cross_entropy

    # hidden as given: a DTensor (FusedHead.tp_input, sequence-sharded) is gathered by the op
    # and its gradient reduce-scattered by DTensor; a plain replica's gradient is all-reduced
    # by the op. (Redistributing a DTensor to Replicate here would turn that reduce-scatter
    # into an all-reduce: the backward of a redistribute returns the gradient replicated.)
    return vocab_parallel_cross_entropy(hidden, weight, labels, bias, reduction="sum")


def _refuse_layouts(job_config, parallel_dims) -> None:
    if parallel_dims is not None and parallel_dims.pp_enabled:
        raise TorchtitanIntegrationError(
            "cce_compile's fused loss does not support pipeline parallelism yet; run with "
            "torchtitan's own model name"
        )
    if job_config.parallelism.fsdp_reshard_after_forward == "always":
        raise TorchtitanIntegrationError(
            "fsdp_reshard_after_forward='always' reshards the head before the fused loss reads "
            "it; use 'default' (or 'never')"
        )


def build_fused_loss(job_config, **kwargs):
    """torchtitan 0.2.x ``build_loss_fn``: ``loss_fn(pred, labels)`` -> the summed fused
    cross-entropy of the hidden states ``pred`` against the FusedHead's weight. It is not
    compiled (``compile.components = ['loss']`` has nothing to fuse: the op is the kernel)."""
    _refuse_layouts(job_config, kwargs.get("parallel_dims"))
    said = []

    def loss_fn(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head = _model_head()
        given = head.tp_input(pred)  # TP: the head's input; pred is a stand-in
        if given is None and pred.shape[-2] == 0 < labels.shape[-1]:
            raise TorchtitanIntegrationError(
                "the fused loss got an empty stand-in that is not the latest output of the "
                "model's FusedHead under tensor parallelism (or was used already): call the "
                "loss once per forward, on that forward's output"
            )
        hidden = pred if given is None else given
        loss = fused_cross_entropy(hidden, head, labels)
        if not said:
            said.append(True)
            log.info(
                "cce_compile: torchtitan loss fused (no logits): head %s, hidden %s",
                _describe(head.weight),
                _describe(hidden),
            )
        return loss

    return loss_fn


def _describe(tensor: torch.Tensor) -> str:
    placements = getattr(tensor, "placements", None)
    where = f" {tuple(placements)}" if placements is not None else ""
    return f"{type(tensor).__name__}{tuple(tensor.shape)}{where}"


def register(base: str = "llama3") -> str:
    """Register ``<base>_cce``: torchtitan's TrainSpec ``base`` with a FusedHead and the fused
    loss. Returns the new name (registering it again is a no-op)."""
    from torchtitan.protocols import train_spec as specs

    name = f"{base}_cce"
    registered = specs._extra_train_specs.get(name)
    if registered is not None:
        if registered.build_loss_fn is not build_fused_loss:
            raise TorchtitanIntegrationError(f"another TrainSpec is registered as {name!r}")
        return name
    spec = specs.get_train_spec(base)
    fused = dataclasses.replace(
        spec, model_cls=_fused_model_class(spec.model_cls), build_loss_fn=build_fused_loss
    )
    specs.register_train_spec(name, fused)
    return name


def _installed_version() -> tuple[int, int]:
    try:
        import torchtitan
    except ImportError as exc:
        raise TorchtitanIntegrationError(
            f"cce_compile.integrations.torchtitan needs torchtitan importable: {exc}"
        ) from exc
    return check_torchtitan_version(torchtitan.__version__)


TORCHTITAN = _installed_version()

if TORCHTITAN == (0, 2):
    register("llama3")

if TORCHTITAN == (0, 3):
    from dataclasses import dataclass
    from typing import Any

    from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import override

    class FusedLoss(ChunkedLossWrapper):
        """torchtitan 0.3 loss: sum over non-ignored tokens of CE(lm_head(hidden), labels),
        divided by ``global_valid_tokens``, in one fused op (no logits).

        A ``ChunkedLossWrapper`` only so that the trainer hands it the head (``set_lm_head``)
        and sets the model's ``_skip_lm_head``; nothing is chunked."""

        @dataclass(kw_only=True, slots=True)
        class Config(ChunkedLossWrapper.Config):
            global_vocab_size: int | None = None
            """The whole vocabulary (from torchtitan's CrossEntropyLoss config): a head with
            fewer rows is a tensor-parallel shard, which is refused."""

        def __init__(self, config: Config, *, compile_config=None):
            # Not ChunkedLossWrapper.__init__: it builds an inner loss that is never used.
            self.num_chunks = 1
            self.loss_fn = None
            self.lm_head = None
            self.global_vocab_size = config.global_vocab_size
            self._said = False

        def __call__(
            self,
            pred: torch.Tensor,
            labels: torch.Tensor,
            global_valid_tokens: torch.Tensor | None = None,
            **loss_inputs: Any,
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            head = self.lm_head
            if head is None:
                raise TorchtitanIntegrationError("the trainer did not set the lm_head")
            loss = _through_head(head, pred, labels, self.global_vocab_size)
            if not self._said:
                self._said = True
                log.info(
                    "cce_compile: torchtitan loss fused (no logits): head %s, hidden %s",
                    _describe(head.weight),
                    _describe(pred),
                )
            if global_valid_tokens is not None:
                loss = loss / global_valid_tokens
            return loss, {}

    def _through_head(head: nn.Module, hidden, labels, vocab: int | None) -> torch.Tensor:
        """The summed fused loss computed inside ``head``'s own call, its ``forward`` swapped
        for the duration: FSDP2's hooks on the head (unshard, and in the backward the
        re-gather and the reduce-scatter of its gradient) run as for torchtitan's loss."""

        def fused_forward(module, hidden, labels):
            _refuse_tensor_parallel(module, vocab)
            return linear_cross_entropy(hidden, module.weight, labels, module.bias, reduction="sum")

        saved = head.__dict__.get("forward")
        head.forward = fused_forward.__get__(head)
        try:
            return head(hidden, labels)
        finally:
            if saved is None:
                del head.forward
            else:
                head.forward = saved

    def _refuse_tensor_parallel(head: nn.Module, vocab: int | None) -> None:
        from torch.distributed.tensor import DTensor

        weight = head.weight
        full = vocab if vocab is not None else getattr(head, "out_features", weight.shape[0])
        if isinstance(weight, DTensor) or weight.shape[0] != full:
            raise TorchtitanIntegrationError(
                f"the lm_head is sharded for tensor parallelism ({type(weight).__name__} "
                f"{tuple(weight.shape)}, vocabulary {full}): cce_compile's torchtitan 0.3 loss "
                "does not support it yet; run TP without --override.imports ...cce_loss"
            )

    @override(
        target=BaseLoss.Config,
        fqns=["loss"],
        description="cce_compile: fused lm_head + cross-entropy (no logits)",
    )
    def cce_loss(config: BaseLoss.Config) -> FusedLoss.Config:
        """Replace torchtitan's CrossEntropyLoss (plain, or inside a ChunkedLossWrapper) at
        ``loss``; any other loss is refused (the op computes a cross-entropy only)."""
        inner = config.loss_fn if type(config) is ChunkedLossWrapper.Config else config
        if type(inner) is not CrossEntropyLoss.Config:
            raise TorchtitanIntegrationError(
                "cce_loss replaces torchtitan's CrossEntropyLoss; this config's loss is "
                f"{type(inner).__qualname__}"
            )
        return FusedLoss.Config(global_vocab_size=inner.global_vocab_size)

"""Integrations with training stacks that never show the graph pass ``linear -> cross_entropy``.

Each is opt-in and imports its stack only when used (``import cce_compile`` imports neither):

* ``cce_compile.integrations.trl``: TRL 1.16's fused LM head (every trainer's
  ``fused_lm_head=True`` forward) computed by cce_compile's op: ``install()`` / ``uninstall()``
  / ``installed()`` / ``counts()``. docs/trl.md.
* ``cce_compile.integrations.torchtitan``: torchtitan 0.2.x's ``llama3_cce`` TrainSpec (the
  model returns its hidden states, the loss is the fused op), loaded by torchtitan's own
  ``--experimental.custom_import cce_compile.integrations.torchtitan --model.name llama3_cce``;
  torchtitan 0.3.x's override ``--override.imports cce_compile.integrations.torchtitan.cce_loss``.
  docs/torchtitan.md.

and one that ``cce_compile.enable()`` installs itself (``CCE_COMPILE=1`` included):

* ``cce_compile.integrations.accelerate_fsdp2``: accelerate's FSDP2 preparation of a compiled
  model keeps ``lm_head`` in the root unit, so that the head and the loss meet in one graph
  (``uninstall()`` restores accelerate's own ``[norm, lm_head]`` unit). docs/distributed.md.
"""

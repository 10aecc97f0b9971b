"""Triton kernels: one kernel per file, each with a launcher that checks shapes.

* ``lse_forward``: logits tile by tile -> per-tile log-sum-exp partials, target logit (lean
  forward; nothing N x V is stored).
* ``logit_grad``: recomputes a vocabulary slab of logits and writes d loss / d logits for it
  (lean backward; the two GEMMs that consume the slab run on cuBLAS).
* ``chunk_softmax_grad``: turns a chunk of materialised logits into its gradient in place, with
  per-row statistics (fast mode); over a vocabulary shard, its two passes run apart
  (``chunk_row_stats``, then the gradient with a given lse).
* ``logits_exp``: fast mode's logits GEMM whose epilogue writes each chunk's exp(z - tile max)
  in the compute dtype, with per-tile maxima and partial lse (no float32 logits).
* ``scaled_exp_grad``: reduces the partials to each row's lse and turns those exponentials into
  the gradient in place.
* ``kept_first``: compaction's kept-first order of the rows and their count in one launch,
  with no host synchronisation (fast mode waits for the count after its first GEMM).
* ``scale_cast``: (x * scale).to(dtype) in one pass: fast mode's backward scaling its float32
  unit-upstream gradients by the upstream gradient.

Kernels import nothing from cce_compile but ``common``.
"""

"""The graph rewrite: find ``linear -> cross_entropy`` in Dynamo graphs and insert the op.

One pipeline for every kind of head: find the loss nodes, match each (the shared walk back to
the head, then the checks of its kind: a plain head or a vocabulary-sharded DTensor head), and
rewrite each site with its kind's surgery, emitted through one emitter.

Matching (a loss node -> a ``Site`` to rewrite, or a ``Rejection`` with its reason):

* ``matching``: ``find_sites`` / ``match_site``: every loss node of a graph, sent to its kind.
* ``walk``: the loss's options and the walk from its input back to the head (views, casts, row
  slices, scaling, softcap), shared by both kinds.
* ``escapes``: the logits' other users: dead code (ignored), z-loss logsumexps the op serves,
  and escaping users (``CCE_ESCAPING_LOGITS``).
* ``safety``: what would make a rewrite compute something else (in-place writes, grad mode,
  bad constants), and which nodes are dead code.
* ``predicates``: small tests on one FX node.
* ``verdicts``: what matching returns: ``Site`` (the base of each kind's site, with its
  ``rewrite`` hook) or ``Rejection``, and the reason codes.

The kinds of head, each its site, its own checks and its surgery:

* ``plain``: a single-device head -> ``cce::linear_cross_entropy``.
* ``tensor_parallel``: a ``ColwiseParallel`` DTensor head -> ``cce::vocab_parallel_cross_entropy``.

Rewriting:

* ``emit``: the ``Emitter`` and what both surgeries emit alike (canonical hidden, targets, the
  op's loss options, the loss's replacement, erasing what became unused).

Running and reporting:

* ``graph_pass``: the ``CustomGraphPass`` (uuid, counters, logging) that runs the pipeline.
* ``install``: ``enable()`` / ``disable()`` on Inductor's pre-grad hook.
* ``tracing``: Dynamo set-up that keeps a head and its loss in one graph (transformers' logging).
* ``report``: ``explain()`` and ``watch()``.
* ``report_types``: ``SiteReport``, ``GraphBreak`` and ``Report``, and ``describe`` for a site.
* ``graph_breaks``: where Dynamo cut graphs, which break separates a head from its loss and
  what removes it, and the frames it ran without compiling.

This package imports the op; the op never imports it.
"""

"""The graph rewrite: find ``linear -> cross_entropy`` in Dynamo graphs and insert the op.

One pipeline for every kind of head: rewrite RL's forms into the loss form the matcher knows,
find the loss nodes, match each (the shared walk back to the head, then the checks of its kind:
a plain head or a vocabulary-sharded DTensor head), put back the RL rewrites no match uses, and
rewrite each site with its kind's surgery, emitted through one emitter.

Before matching (RL's log-probs and entropy, docs/graph_forms.md section 10):

* ``rules``: the rules, one function per form: in-place temperature, log-probs
  (``log_softmax`` + ``gather``, ``gather`` - ``logsumexp``), entropy, and their lowering into a
  ``cross_entropy(reduction="none")`` the matcher fuses.
* ``piecewise``: the one rule for loops over rows and chunks (``stack`` / ``cat`` of the same
  row-wise function of pieces that cover a tensor).
* ``canonical``: the canonical ops the rules write, ``cce::token_log_probs`` and
  ``cce::softmax_entropy`` (CompositeImplicitAutograd).
* ``calls``: the spellings of one torch op (function or method), read by argument name.
* ``journal``: what the rules changed, rolled back where no rewritten site uses it.

Matching (a loss node -> a ``Site`` to rewrite, or a ``Rejection`` with its reason):

* ``matching``: ``find_sites`` / ``match_site``: every loss node of a graph, sent to its kind;
  ``settled_sites``: matched again until the rules' rewrites that no site uses are rolled back.
* ``walk``: the loss's options and the walk from its input back to the head (views, casts, row
  slices, scaling, softcap), shared by both kinds.
* ``escapes``: the logits' other users: dead code (ignored), z-loss logsumexps and entropies
  the op serves, and escaping users (``CCE_ESCAPING_LOGITS``).
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

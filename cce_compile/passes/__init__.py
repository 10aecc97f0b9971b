"""The graph rewrite: find ``linear -> cross_entropy`` in Dynamo graphs and insert the op.

* ``predicates``: small tests on FX nodes.
* ``matching``: sites (and rejections with reasons) from loss nodes back to the head.
* ``rewrite``: the surgery for one site.
* ``graph_pass``: the ``CustomGraphPass`` (uuid, counters, logging) that runs them.
* ``install``: ``enable()`` / ``disable()`` on Inductor's pre-grad hook.
* ``tracing``: Dynamo set-up that keeps a head and its loss in one graph (transformers' logging).
* ``report``: ``explain()`` and ``watch()``.
* ``report_types``: ``SiteReport``, ``GraphBreak`` and ``Report``, and ``describe`` for a site.
* ``graph_breaks``: where Dynamo cut graphs, which break separates a head from its loss and
  what removes it, and the frames it ran without compiling.

This package imports the op; the op never imports it.
"""

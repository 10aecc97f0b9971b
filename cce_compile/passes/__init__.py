"""The graph rewrite: find ``linear -> cross_entropy`` in Dynamo graphs and insert the op.

* ``predicates``: small tests on FX nodes.
* ``matching``: sites (and rejections with reasons) from loss nodes back to the head.
* ``rewrite``: the surgery for one site.
* ``graph_pass``: the ``CustomGraphPass`` (uuid, counters, logging) that runs them.
* ``install``: ``enable()`` / ``disable()`` on Inductor's pre-grad hook.
* ``report``: ``explain()`` and the per-site reports.

This package imports the op; the op never imports it.
"""

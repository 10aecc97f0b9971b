"""The ``cce`` custom ops, from their argument lists to the rows they compute on.

* ``signature``: the ops' argument and output lists, by name (the schemas come from them);
* ``custom_ops``: ``torch.ops.cce.linear_cross_entropy`` and its backward op, their fake
  kernels and their autograd formula (fast mode's buffers handed to autograd);
* ``dispatch``: what a call runs, forward and backward, on the rows that count;
* ``call_plan``: the implementation for a device, autocast off, the budget, the needs;
* ``compaction``: skipping the rows whose target is ignored (one host sync);
* ``versioning``: the hash that keeps compiled graphs of other versions out.

The implementations behind ``dispatch`` are in ``cce_compile.implementations``.
"""

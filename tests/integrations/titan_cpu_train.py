"""Test-only launcher: torchtitan 0.2.2's own trainer (``torchtitan.train``) on CPU with gloo.

torchtitan picks its device from ``torch._utils._get_available_device_type() or "cuda"``, so on
a CPU-only torch it stops at ``torch.cuda.set_device``. This makes the device "cpu" and patches
only what then fails on CPU (none of it touches the model, the loss or the parallelisms):

* the metrics' CUDA memory monitor -> one that reports zeros;
* the barrier after step 1 (``set_pg_timeouts``: gloo refuses ``device_ids=["cpu"]``) -> skipped;
* FSDP2's reduce-scatter with ``PREMUL_SUM`` (torchtitan's gradient divide factor 1.0; gloo has
  no PREMUL_SUM) -> SUM (dividing by 1.0 changes nothing).

It also adds the tiny flavor ``cputest`` to llama3's (so to llama3_cce's) model arguments.

    torchrun --standalone --nproc-per-node 2 tests/integrations/titan_cpu_train.py \\
        --job.config_file job.toml [--experimental.custom_import ... --model.name llama3_cce]
"""

from __future__ import annotations

import runpy
import sys

import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"  # before torchtitan reads it

from torchtitan.components import metrics  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.models.llama3 import TransformerModelArgs, llama3_args  # noqa: E402
from torchtitan.models.llama3.infra import parallelize  # noqa: E402


class _ZeroMemoryMonitor:
    device_name = "cpu"
    device_capacity_gib = 0.0

    def get_peak_stats(self):
        return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self):
        pass


def _divide_off_with_sum_reductions(model):
    from torch.distributed.fsdp import FSDPModule

    _divide_off(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


metrics.build_device_memory_monitor = _ZeroMemoryMonitor
dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
_divide_off = parallelize.disable_fsdp_gradient_division
parallelize.disable_fsdp_gradient_division = _divide_off_with_sum_reductions
llama3_args["cputest"] = TransformerModelArgs(
    dim=64, n_layers=2, n_heads=4, vocab_size=512, rope_theta=500000
)

if __name__ == "__main__":
    sys.argv[0] = "torchtitan.train"
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)

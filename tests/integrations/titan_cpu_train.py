"""Test-only launcher: torchtitan's own trainer (``torchtitan.train``; 0.2.2 or 0.3.0) on CPU with
gloo.

torchtitan picks its device from ``torch._utils._get_available_device_type() or "cuda"``, so on
a CPU-only torch it stops at ``torch.cuda.set_device``. This makes the device "cpu" and patches
only what then fails on CPU (none of it touches the model, the loss or the parallelisms):

* the metrics' CUDA memory monitor -> one that reports zeros;
* the barrier after step 1 (``set_pg_timeouts``: gloo refuses ``device_ids=["cpu"]``) -> skipped;
* FSDP2's reduce-scatter with ``PREMUL_SUM`` (torchtitan's gradient divide factor 1.0; gloo has
  no PREMUL_SUM) -> SUM (dividing by 1.0 changes nothing).

On 0.2.2 it also adds the tiny flavor ``cputest`` to llama3's (so to llama3_cce's) model
arguments. On 0.3, FlexAttention has no CPU backward: add ``--override.imports
titan_cpu_attention.cpu_flex_attention`` (this directory is the script's, so on sys.path).

    torchrun --standalone --nproc-per-node 2 tests/integrations/titan_cpu_train.py <trainer flags>

On 0.2.2, several trainer runs in one job: their flags separated by ``--then``
(titan_job.RUN_SEPARATOR). They follow one another in each rank, on the same process group (kept
between runs, so torchtitan's ``init_distributed`` finds it), each announced by a line of its
own (titan_job.RUN_MARKER), each parsing its own flags (0.2.2's ``ConfigManager.parse_args``
reads ``sys.argv`` as it was at import unless given its arguments).
"""

from __future__ import annotations

import importlib
import runpy
import sys

import torch._utils

torch._utils._get_available_device_type = lambda: "cpu"  # before torchtitan reads it

import torchtitan  # noqa: E402
from torchtitan.components import metrics  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402

# where each release defines, and calls, disable_fsdp_gradient_division
FSDP_SETUP = {
    "0.2": "torchtitan.models.llama3.infra.parallelize",
    "0.3": "torchtitan.distributed.fsdp",
}


class _ZeroMemoryMonitor:
    device_name = "cpu"
    device_capacity_gib = 0.0

    def get_peak_stats(self):
        return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

    def reset_peak_stats(self):
        pass


def _with_sum_reductions(divide_off):
    def divide_off_with_sum_reductions(model):
        from torch.distributed.fsdp import FSDPModule

        divide_off(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    return divide_off_with_sum_reductions


def _patch() -> None:
    metrics.build_device_memory_monitor = _ZeroMemoryMonitor
    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
    release = ".".join(torchtitan.__version__.split(".")[:2])
    fsdp_setup = importlib.import_module(FSDP_SETUP[release])
    fsdp_setup.disable_fsdp_gradient_division = _with_sum_reductions(
        fsdp_setup.disable_fsdp_gradient_division
    )
    if release == "0.2":
        from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

        llama3_args["cputest"] = TransformerModelArgs(
            dim=64, n_layers=2, n_heads=4, vocab_size=512, rope_theta=500000
        )


def _runs(argv: list[str], separator: str) -> list[list[str]]:
    runs = [[]]
    for arg in argv:
        if arg == separator:
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


if __name__ == "__main__":
    _patch()
    from titan_job import RUN_MARKER, RUN_SEPARATOR

    runs = _runs(sys.argv[1:], RUN_SEPARATOR)
    if len(runs) > 1:
        from torchtitan.config import ConfigManager

        parse_args = ConfigManager.parse_args
        ConfigManager.parse_args = lambda self, args=None: parse_args(
            self, sys.argv[1:] if args is None else args
        )
    destroy_process_group = torch.distributed.destroy_process_group
    for number, flags in enumerate(runs, 1):
        print(f"{RUN_MARKER} {number}", flush=True)
        last = number == len(runs)
        torch.distributed.destroy_process_group = destroy_process_group if last else lambda: None
        sys.argv = ["torchtitan.train", *flags]
        runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)

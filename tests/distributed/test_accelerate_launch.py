"""``accelerate launch`` on two CPU processes (gloo) runs a Trainer script that knows nothing
of cce_compile: with CCE_COMPILE=1 and CCE_ESCAPING_LOGITS=drop each rank's loss is fused,
and the logged losses are those of the same model trained without compile. One launch trains
both, eagerly then compiled (a launch costs ~15 s of CPU before training: torchrun and two
ranks importing torch and transformers), and Inductor stops before its code generation
(tests/fresh_process.py): its code for the op is not what this test is about.

The command is ``accelerate launch --multi_gpu --num_processes 2`` with ``use_cpu=True`` in
the script: accelerate 1.15's ``--cpu --num_processes 2`` starts a single process (its
multi-CPU launch goes through mpirun), and ``--multi_gpu`` is its torchrun launcher, which on
a machine without GPUs gives gloo ranks to a Trainer whose arguments say ``use_cpu``.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch
from oracle import COMPILED_VS_EAGER_RTOL

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = pathlib.Path(__file__).with_name("trainer_script.py")
REPO = pathlib.Path(__file__).resolve().parents[2]
WORLD = 2
# The compiled run's model is compiled by Inductor, whose float32 kernels round differently.
RTOL = COMPILED_VS_EAGER_RTOL[torch.float32]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out: pathlib.Path, environ: dict[str, str], *script_args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_")} | environ
    # The ranks import this tree's cce_compile and tests/fresh_process.py; no accelerate config
    # file of the user's.
    paths = [str(REPO), str(REPO / "tests"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env["HF_HOME"] = str(out / "hf_home")
    env["OMP_NUM_THREADS"] = "1"  # two processes on the CI's two cores
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.accelerate_cli",
        "launch",
        "--multi_gpu",
        f"--num_processes={WORLD}",
        "--num_machines=1",
        "--mixed_precision=no",
        "--dynamo_backend=no",
        f"--main_process_port={_free_port()}",
        str(SCRIPT),
        str(out),
        *script_args,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["world"] for r in reports] == [WORLD] * WORLD, reports
    return reports


@pytest.mark.slow
def test_accelerate_launch_trainer_is_fused_on_every_rank(tmp_path):
    reports = _launch(
        tmp_path,
        {"CCE_COMPILE": "1", "CCE_ESCAPING_LOGITS": "drop"},
        "--torch-compile",
        "--inductor-without-codegen",
    )
    for rank, report in enumerate(reports):
        got, want = report["compiled"], report["eager"]
        assert got["cce_compile"].get("rewritten", 0) >= 1, (rank, got["cce_compile"])
        assert not want["cce_compile"], (rank, want["cce_compile"])
        assert len(got["losses"]) == len(want["losses"]) == 3
        for a, b in zip(got["losses"], want["losses"]):
            assert abs(a - b) <= RTOL * abs(b) + 1e-6, (rank, got["losses"], want["losses"])

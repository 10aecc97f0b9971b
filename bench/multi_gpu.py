"""Issue 40's GPU measurements in one command, on a machine of 2 (or 4) GPUs, NCCL::

    python3 bench/multi_gpu.py --out $OUT --commit <sha> --wheels .whl_titan

Each part runs in its own processes, bounded by its own time cap and by ``--budget-s`` for the
whole command (a part that would start with too little time left is skipped, and says so), in
this order:

1. ``titan03``, a probe: does torchtitan 0.3.0 import beside this torch (carried as wheels
   under ``<wheels>/v03``)?
2. ``titan``: torchtitan 0.2's own trainer, FSDP2 and TP 2 (FSDP2 x TP 2 on 4 GPUs), a debug
   Llama at V 128256, fused against unfused and against unfused after a one-ulp change of the
   initial weights (``bench/multi_gpu_titan.py``);
3. ``ddp``: DDP under torch.compile at default and small buckets, a bucket boundary between the
   head and its loss (``bench/multi_gpu_ddp.py``);
4. ``vp``: the vocabulary-parallel loss against loss_parallel at 8k and 16k tokens, bf16 and
   AMP, 10% and 50% of the targets ignored (``bench/distributed.py --skip-correctness``);
5. ``trainer``: the HF Trainer under ``accelerate launch``, FSDP2 and DDP, with
   ``torch_compile=True``, with ``CCE_COMPILE=1`` and without (``bench/multi_gpu_trainer.py``),
   last: its four launches take what is left.

``--wheels DIR``: Python wheels the machine lacks (torchtitan 0.2.2 and its needs), installed
into a folder put first on the parts' PYTHONPATH; the lent GPU machines reach no registry, so
they travel with the tree (``carry``). Made here, for their Python 3.12::

    echo /.whl_titan/ >> .git/info/exclude
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl_titan torchtitan==0.2.2 torchdata==0.11.0 \
        datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 tyro==1.0.17 \
        docstring-parser==0.18.0 typeguard==4.6.1 fsspec==2026.9.0
    pip download (the same options) -d .whl_titan/v03 torchtitan==0.3.0 spmd_types==0.2.3 \
        torch_checkpointing==0.1.1
 Results: ``multi_gpu.json`` (every number,
with the device, versions, date and commit) and ``multi_gpu.md`` (the tables) in ``--out``,
written again after each part; ``multi_gpu.log``: the end of each part's output.

``--cpu-smoke``: every part on 2 gloo processes at toy sizes (the parts' own ``--cpu-smoke``),
to check the scripts without GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.metadata
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import multi_gpu_report  # noqa: E402

# part: (seconds it may take at most, seconds it needs at least to be worth starting)
CAPS = {
    "titan03": (60, 20),
    "titan": (200, 90),
    "ddp": (120, 45),
    "trainer": (300, 120),
    "vp": (200, 90),
}
# The HF Trainer last: its four launches take what the budget has left (the others are
# bounded by their own caps).
ORDER = ("titan03", "titan", "ddp", "vp", "trainer")
EXIT_GRACE_S = 20  # a part's processes may take this long to exit once its results are written
SMOKE_SLOWER = 10  # CPU smoke: each cap times this (Inductor compiles C++ on two cores)
# NVLink multicast stays off on the lent machines (KINDS.md), also in the parts' own processes.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
FSDP2_FLAGS = (
    "--use_fsdp", "--fsdp_version", "2",
    "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
    "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer",
    "--fsdp_reshard_after_forward", "true",
    "--fsdp_cpu_ram_efficient_loading", "false",
    "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
)  # fmt: skip
# (layout, fused): the HF Trainer runs, each pair fused then unfused so that a cut-short part
# still holds a comparable pair.
TRAINER_RUNS = (("fsdp2", True), ("fsdp2", False), ("ddp", True), ("ddp", False))


class Runner:
    """Starts the parts' processes within the budget and keeps what they printed."""

    def __init__(self, args):
        self.args = args
        self.began = time.monotonic()
        self.scratch = pathlib.Path(tempfile.mkdtemp(prefix="multi_gpu_"))
        self.logs: list[str] = []
        self.checkpoint = lambda: None  # writes the results so far (main sets it)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_")}
        self.env.update(NO_MULTICAST, **OFFLINE, PYTHONUNBUFFERED="1")
        self.env["TOKENIZERS_PARALLELISM"] = "false"
        self.env["OMP_NUM_THREADS"] = "1" if args.cpu_smoke else "4"
        self.env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        )

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.began)

    def run(self, label, command, cap, env=None, done=None) -> int:
        """``command`` in its own session, killed with its children after ``cap`` seconds (or
        what is left of the budget), or ``EXIT_GRACE_S`` after ``done()`` says its results are
        written (a rank that hangs in its process group's teardown costs no more); its
        output's end goes to the log. Returns its status (124: killed at the limit)."""
        limit = max(1.0, min(cap, self.left()))
        began = time.monotonic()
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        finished_at, note = None, ""
        while True:
            try:
                output, _ = proc.communicate(timeout=2)
                status = proc.returncode
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if finished_at is None and done is not None and done():
                    finished_at = now
                late = finished_at is not None and now - finished_at > EXIT_GRACE_S
                if now - began > limit or late:
                    os.killpg(proc.pid, signal.SIGKILL)
                    output, _ = proc.communicate()
                    status, note = (0, " (results written; stopped at exit)") if late else (124, "")
                    break
        took = time.monotonic() - began
        tail = "\n".join(line for line in output.splitlines() if "Warning" not in line)[-6000:]
        self.logs.append(f"=== {label}: status {status}{note}, {took:.0f} s\n{tail}\n")
        print(f"[multi_gpu] {label}: status {status}{note}, {took:.0f} s", flush=True)
        return status

    def torchrun(self, label, script, gpus, cap, *script_args, env=None, done=None) -> int:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(gpus),
            str(BENCH / script),
            *script_args,
        ]
        return self.run(label, command, cap, env, done)


def install_wheels(runner: Runner, folder: pathlib.Path, target: pathlib.Path) -> bool:
    wheels = sorted(glob.glob(str(folder / "*.whl")))
    if not wheels:
        return False
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(target),
        *wheels,
    ]
    return runner.run(f"install {folder.name}", command, 120) == 0


def part_titan03(runner: Runner, results: dict) -> None:
    folder = runner.args.wheels / "v03" if runner.args.wheels else None
    if folder is None or not install_wheels(runner, folder, runner.scratch / "site03"):
        results["titan03"] = dict(skipped="no torchtitan 0.3 wheels given")
        return
    site = os.pathsep.join([str(runner.scratch / "site03"), runner.env["PYTHONPATH"]])
    probe = (
        "import torch, torchtitan; print('torchtitan', torchtitan.__version__, 'torch', "
        "torch.__version__); import torchtitan.trainer; "
        "import cce_compile.integrations.torchtitan as t; print('integration', t.TORCHTITAN)"
    )
    status = runner.run(
        "titan03", [sys.executable, "-c", probe], CAPS["titan03"][0], env={"PYTHONPATH": site}
    )
    results["titan03"] = dict(status=status, output=runner.logs[-1][-2000:])


def part_titan(runner: Runner, results: dict) -> None:
    out = runner.scratch / "titan"
    extra = ["--cpu-smoke"] if runner.args.cpu_smoke else []
    status = runner.torchrun(
        "titan",
        "multi_gpu_titan.py",
        runner.args.gpus,
        CAPS["titan"][0],
        "--out",
        str(out),
        "--workdir",
        str(runner.scratch / "titan_work"),
        *extra,
        done=(out / "titan.json").exists,
    )
    results["titan"] = _read_json(out / "titan.json", status)


def part_ddp(runner: Runner, results: dict) -> None:
    out = runner.scratch / "ddp"
    extra = ["--cpu-smoke"] if runner.args.cpu_smoke else []
    status = runner.torchrun(
        "ddp",
        "multi_gpu_ddp.py",
        runner.args.gpus,
        CAPS["ddp"][0],
        "--out",
        str(out),
        *extra,
        done=(out / "ddp.json").exists,
    )
    results["ddp"] = _read_json(out / "ddp.json", status)


HOOK_PROBE = "import sys; print('cce_compile._autoenable' in sys.modules)"


def install_startup_hook(runner: Runner) -> str:
    """Makes ``CCE_COMPILE=1`` work in the parts' interpreters as after ``pip install``: the
    tree only on PYTHONPATH has no start-up hook (Python reads ``.pth`` files in site-packages
    alone), so its ``.pth`` is copied there once. Returns where the hook is, or why not."""
    probe = [sys.executable, "-c", HOOK_PROBE]
    env = {**runner.env, "CCE_COMPILE": "1"}

    def active() -> bool:
        done = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120)
        return done.stdout.strip() == "True"

    if active():
        return "installed"
    import site

    for folder in [*site.getsitepackages(), site.getusersitepackages()]:
        try:
            pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
            target = pathlib.Path(folder) / "cce_compile_autoenable.pth"
            target.write_text((ROOT / "cce_compile_autoenable.pth").read_text())
        except OSError:
            continue
        if active():
            return str(target)
        target.unlink()
    return "not installed: no writable site-packages reads it"


def part_trainer(runner: Runner, results: dict) -> None:
    """The HF Trainer runs in TRAINER_RUNS order, each launch bounded by what is left of the
    part's cap; a launch that could not finish a run is not started."""
    runs = results["trainer"] = {}
    hook = install_startup_hook(runner)
    results["trainer_startup_hook"] = hook
    print(f"[multi_gpu] start-up hook: {hook}", flush=True)
    deadline = time.monotonic() + CAPS["trainer"][0]
    least = CAPS["trainer"][1] / len(TRAINER_RUNS)
    for index, (layout, fused) in enumerate(TRAINER_RUNS):
        name = f"{layout}-{'fused' if fused else 'unfused'}"
        part_left = deadline - time.monotonic()
        if min(part_left, runner.left()) < least:
            runs[name] = dict(skipped=f"{min(part_left, runner.left()):.0f} s left")
            continue
        out = runner.scratch / "trainer" / name
        launch = [
            sys.executable,
            "-m",
            "accelerate.commands.accelerate_cli",
            "launch",
            f"--num_processes={runner.args.gpus}",
            "--num_machines=1",
            "--mixed_precision=no" if runner.args.cpu_smoke else "--mixed_precision=bf16",
            "--dynamo_backend=no",
            f"--main_process_port={29533 + index}",
        ]
        launch += list(FSDP2_FLAGS) if layout == "fsdp2" else ["--multi_gpu"]
        launch += [str(BENCH / "multi_gpu_trainer.py"), str(out)]
        launch += ["--cpu-smoke"] if runner.args.cpu_smoke else []
        # The user's switch: CCE_COMPILE=1 installs the pass at the first torch.compile.
        env = {"CCE_COMPILE": "1"} if fused else {}
        env["HF_HOME"] = str(runner.scratch / "hf_home")
        gpus = runner.args.gpus

        def written(out=out, gpus=gpus):
            return len(list(out.glob("rank*.json"))) == gpus

        status = runner.run(f"trainer {name}", launch, part_left, env, done=written)
        reports = [_read_json(path, status) for path in sorted(out.glob("rank*.json"))]
        runs[name] = dict(status=status, ranks=reports)
        runner.checkpoint()  # (a run cut short by the command's own limit keeps the others)


def part_vp(runner: Runner, results: dict) -> None:
    out = runner.scratch / "vp"
    args = [
        "--out",
        str(out),
        "--skip-correctness",
        "--methods",
        runner.args.vp_methods,
        "--reps",
        "10",
        "--warmup",
        "3",
    ]
    if runner.args.cpu_smoke:
        args += ["--smoke", "--reps", "2", "--warmup", "1"]
    status = runner.torchrun(
        "vp",
        "distributed.py",
        runner.args.gpus,
        CAPS["vp"][0],
        *args,
        done=(out / "results.md").exists,
    )
    results["vp"] = _read_json(out / "results.json", status)
    markdown = out / "results.md"
    if markdown.exists():
        results["vp"]["markdown"] = markdown.read_text()


def _read_json(path: pathlib.Path, status: int) -> dict:
    if not path.exists():
        return dict(status=status, missing=str(path.name))
    return dict(status=status, **json.loads(path.read_text()))


def environment(args) -> dict:
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    try:
        smi = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.strip()
            .splitlines()
        )
    except (OSError, subprocess.TimeoutExpired):
        smi = []
    commit = args.commit
    if commit is None:
        git = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        commit = git.stdout.strip() or "unknown"
    return dict(
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        commit=commit,
        gpus=smi or ["cpu (smoke)"],
        python=sys.version.split()[0],
        versions={
            n: version(n)
            for n in ("torch", "triton", "transformers", "accelerate", "torchtitan", "datasets")
        },
        command=" ".join(sys.argv),
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--parts", default=",".join(ORDER))
    parser.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument("--commit", default=None, help="the tree's commit (git's where found)")
    parser.add_argument("--wheels", type=pathlib.Path, default=None)
    parser.add_argument("--vp-methods", default="loss_parallel,cce_pass_fast,cce_op_fast")
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.gpus is None:
        args.gpus = 2 if args.cpu_smoke else _visible_gpus()
    if args.cpu_smoke:
        CAPS.update({name: (most * SMOKE_SLOWER, least) for name, (most, least) in CAPS.items()})
    runner = Runner(args)
    if args.wheels and install_wheels(runner, args.wheels, runner.scratch / "site"):
        runner.env["PYTHONPATH"] = os.pathsep.join(
            [str(runner.scratch / "site"), runner.env["PYTHONPATH"]]
        )
        sys.path.insert(0, str(runner.scratch / "site"))
    env = environment(args)
    if args.wheels:  # what the parts import, not what this process saw before the install
        env["versions"]["torchtitan"] = _version_in(runner, "torchtitan")
    results: dict = dict(environment=env, gpus=args.gpus, budget_s=args.budget_s, skipped={})
    args.out.mkdir(parents=True, exist_ok=True)
    runner.checkpoint = lambda: _write(args.out, results, runner)
    parts = {
        "titan03": part_titan03,
        "titan": part_titan,
        "ddp": part_ddp,
        "trainer": part_trainer,
        "vp": part_vp,
    }
    for name in [p for p in ORDER if p in args.parts.split(",")]:
        if runner.left() < CAPS[name][1]:
            results["skipped"][name] = f"{runner.left():.0f} s left of {args.budget_s:.0f} s"
            continue
        parts[name](runner, results)
        _write(args.out, results, runner)
    _write(args.out, results, runner)


def _visible_gpus() -> int:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))


def _version_in(runner: Runner, name: str) -> str | None:
    done = subprocess.run(
        [sys.executable, "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
        env=runner.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.stdout.strip() or None


def _write(out: pathlib.Path, results: dict, runner: Runner) -> None:
    results["elapsed_s"] = round(time.monotonic() - runner.began, 1)
    (out / "multi_gpu.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "multi_gpu.md").write_text(multi_gpu_report.markdown(results))
    (out / "multi_gpu.log").write_text("\n".join(runner.logs))


if __name__ == "__main__":
    main()

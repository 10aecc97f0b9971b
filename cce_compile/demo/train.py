"""Two seeded training runs, plain torch.compile against cce_compile, and what they cost.

Both runs build the same model from the same seed, see the same batches in the same order and
compile the same step (the model's forward returns the loss, so the logits die inside the
graph); only the backend differs. Measured per run: loss curve, tokens/s, peak GPU memory, and
the loss layer's share of step time and memory (the step against the same step with the loss
layer replaced by a trivial loss on the hidden states).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
from torch._dynamo.utils import counters

from .models import ModelConfig, build


@dataclasses.dataclass
class RunConfig:
    arch: str
    model: ModelConfig
    batch: int
    steps: int
    lr: float = 6e-4  # nanoGPT's
    warmup: int = 20
    grad_clip: float = 1.0  # nanoGPT's; GLA in bf16 spikes without it
    seed: int = 0
    device: str = "cpu"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.device == "cuda" else None


@dataclasses.dataclass
class RunResult:
    name: str
    losses: list[float]
    tokens_per_s: float
    step_ms: float
    # GPU: torch.cuda's peak over the run; CPU: the peak of what torch allocates during one
    # training step (the profiler's memory timeline). Each is taken the same way for both runs.
    peak_memory_gb: float | None
    # The loss layer's share: forward+backward of the model with its loss, against the same
    # without the loss layer (no optimizer step in either, same measurement).
    loss_step_ms: float | None = None
    loss_peak_memory_gb: float | None = None
    null_step_ms: float | None = None
    null_peak_memory_gb: float | None = None
    rewritten_sites: int = 0
    max_batch: int | None = None
    max_batch_tokens_per_s: float | None = None

    @property
    def loss_time_share(self) -> float | None:
        if self.null_step_ms is None or self.loss_step_ms is None:
            return None
        return max(0.0, 1 - self.null_step_ms / self.loss_step_ms)

    @property
    def loss_memory_share(self) -> float | None:
        if self.loss_peak_memory_gb is None or self.null_peak_memory_gb is None:
            return None
        return max(0.0, 1 - self.null_peak_memory_gb / self.loss_peak_memory_gb)


def batches(
    ids: torch.Tensor, batch: int, context: int, seed: int, device: str
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random windows of the corpus, in an order fixed by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, ids.numel() - context - 1, (batch,), generator=gen)
        window = torch.stack([ids[s : s + context + 1] for s in starts.tolist()]).long()
        yield window[:, :-1].contiguous().to(device), window[:, 1:].contiguous().to(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _backend(use_cce: bool):
    if use_cce:
        import cce_compile

        return cce_compile.backend
    return "inductor"


def _lr(step: int, cfg: RunConfig) -> float:
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup)


def _make_step(model, cfg: RunConfig, use_cce: bool, loss_fn: str = "forward") -> Callable:
    compiled = torch.compile(getattr(model, loss_fn), backend=_backend(use_cce))
    dtype = cfg.autocast_dtype

    def step(x, y):
        if dtype is None:
            return compiled(x, y)
        with torch.autocast("cuda", dtype=dtype):
            return compiled(x, y)

    return step


def train(
    cfg: RunConfig,
    ids: torch.Tensor,
    use_cce: bool,
    progress: Callable[[int, float, float, float | None], None] | None = None,
) -> RunResult:
    """One training run; ``progress(step, loss, tokens_per_s, memory_gb)`` after each step."""
    torch.manual_seed(cfg.seed)
    model = build(cfg.arch, cfg.model).to(cfg.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    before = counters["cce_compile"]["rewritten"]
    step = _make_step(model, cfg, use_cce)
    data = batches(ids, cfg.batch, cfg.model.context, cfg.seed, cfg.device)
    losses, timed, timed_tokens = [], 0.0, 0
    skip = min(3, cfg.steps - 1)  # compile and warm-up steps are not timed
    if cfg.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(cfg.steps):
        x, y = next(data)
        for group in optimizer.param_groups:
            group["lr"] = _lr(i, cfg)
        _sync(cfg.device)
        start = time.perf_counter()
        loss = step(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # a sync: the step is over
        elapsed = time.perf_counter() - start
        losses.append(value)
        if i >= skip:
            timed += elapsed
            timed_tokens += x.numel()
        if progress is not None:
            rate = timed_tokens / timed if timed else 0.0
            progress(i, value, rate, _peak_gb(cfg.device))
    peak = _peak_gb(cfg.device)
    if cfg.device == "cpu":
        x, y = next(data)
        peak = step_peak_bytes(lambda: step(x, y).backward()) / 2**30
        model.zero_grad(set_to_none=True)
    result = RunResult(
        name="cce_compile" if use_cce else "torch.compile",
        losses=losses,
        tokens_per_s=timed_tokens / timed if timed else float("nan"),
        step_ms=1000 * timed / max(1, cfg.steps - skip),
        peak_memory_gb=peak,
        rewritten_sites=counters["cce_compile"]["rewritten"] - before,
    )
    if cfg.device == "cuda":  # the CPU demo stays short: no extra compiles for the shares
        result.loss_step_ms, result.loss_peak_memory_gb = _measure(
            model, cfg, use_cce, "forward", steps=21
        )
        result.null_step_ms, result.null_peak_memory_gb = _measure(
            model, cfg, use_cce, "null_loss", steps=21
        )
    return result


def step_peak_bytes(run: Callable[[], None]) -> int:
    """The most memory torch holds at once during ``run()`` beyond what existed before it
    (allocations and frees from the profiler's memory timeline; works on the CPU, where torch
    keeps no allocator statistics)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    with (
        _without_kineto_banners(),
        profile(
            activities=[ProfilerActivity.CPU],
            profile_memory=True,
            record_shapes=True,
            with_stack=True,
        ) as prof,
    ):
        run()
    live = peak = 0
    for _, action, (key, _), size in prof._memory_profile().timeline:
        if key.device.type != "cpu":
            continue
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


# "USDT:2026-01-01 10:00:00 123:123 SyncActivityProfilerHandler.cpp:52] profiler_start"
_KINETO_BANNER = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def _without_kineto_banners() -> Iterator[None]:
    """Kineto, the profiler's C++ side, writes "USDT: ... profiler_start" and "profiler_stop"
    to file descriptor 2 on every profile (its log level is read once per process from the
    environment, which only config.py reads). Inside the block, descriptor 2 goes to a file;
    after it, everything but those lines is written back to stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured if not _KINETO_BANNER.match(line)]
            if kept:
                sys.stderr.write(b"".join(kept).decode(errors="replace"))
                sys.stderr.flush()


def _peak_gb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def _measure(
    model,
    cfg: RunConfig,
    use_cce: bool,
    loss_fn: str,
    batch: int | None = None,
    steps: int = 5,
    dynamic_batch: bool = False,
) -> tuple[float, float | None]:
    """(ms per fwd+bwd step, peak GB) of ``model.<loss_fn>`` at ``batch``; no optimizer step.

    ``dynamic_batch`` compiles the batch dimension as symbolic, so that trying many batch
    sizes compiles once rather than once per size."""
    step = _make_step(model, cfg, use_cce, loss_fn)
    data = batches(
        torch.arange(cfg.model.vocab, dtype=torch.int32).repeat(64),
        batch or cfg.batch,
        cfg.model.context,
        cfg.seed + 1,
        cfg.device,
    )
    x, y = next(data)
    if dynamic_batch:
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(y, 0)
    for _ in range(2):  # compile, warm up
        step(x, y).backward()
    model.zero_grad(set_to_none=True)
    _sync(cfg.device)
    if cfg.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step(x, y).backward()
        _sync(cfg.device)
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    # The median: a 6 ms step timed over a few steps picked up host hiccups of a millisecond.
    return 1000 * statistics.median(times), _peak_gb(cfg.device)


def max_batch(
    cfg: RunConfig,
    use_cce: bool,
    start: int,
    limit: int = 4096,
    report: Callable[[int, float | None], None] | None = None,
) -> tuple[int, float]:
    """Largest batch (doubling, then one bisection step) whose training step fits on the GPU,
    and tokens/s there; ``report(batch, tokens_per_s or None)`` after each try.

    The step is compiled once with a symbolic batch dimension (a static compile per size took
    most of the search's time); both runs are measured the same way."""
    torch.manual_seed(cfg.seed)
    model = build(cfg.arch, cfg.model).to(cfg.device)

    def fits(batch: int) -> float | None:
        try:
            ms, _ = _measure(model, cfg, use_cce, "forward", batch=batch, dynamic_batch=True)
            rate = batch * cfg.model.context / (ms / 1000)
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            rate = None
        if report is not None:
            report(batch, rate)
        return rate

    best, rate = 0, 0.0
    batch = start
    while batch <= limit:
        measured = fits(batch)
        if measured is None:
            break
        best, rate = batch, measured
        batch *= 2
    if best and best * 2 <= limit:
        middle = best + best // 2
        measured = fits(middle)
        if measured is not None:
            best, rate = middle, measured
    return best, rate

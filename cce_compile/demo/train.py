"""Plain torch.compile against cce_compile, trained side by side, and what each costs.

Both runs build the same model from the same seed, see the same batches in the same order and
compile the same step (the model's forward returns the loss, so the logits die inside the
graph); only the backend differs. They train interleaved: one step of each in turn, the order
swapped every step, so that a machine that slows down (other work, a throttled core) slows both
alike. Their first ``WARM_STEPS`` steps (compilation, warm-up) are not timed.

Speed: each block of ``BLOCK_STEPS`` timed steps (both orders) gives one ratio of the two runs'
tokens/s; the demo reports the median ratio with its spread (quartiles, min-max), and each
run's tokens/s at its median step time.

Exactness: step 0 (same weights, same batch) compares the losses and every gradient. Later
steps diverge as training amplifies rounding differences; the control run (``control=True``:
torch.compile against itself, every initial weight moved by one float32 ulp) shows how a
rounding-sized difference grows without cce_compile. The relative distance between the runs'
weights after every step shows that growth before the losses, rounded to float32, do.

Also measured per run: peak memory (GPU: torch.cuda's peak during its steps, less what the
other runs hold; CPU: the peak of what torch allocates during one training step) and, on the
GPU, the loss layer's share of step time and memory (the step against the same step with the
loss layer replaced by a trivial loss on the hidden states).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
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

WARM_STEPS = 2  # step 0 compiles forward and backward; step 1 still runs slower
BLOCK_STEPS = 2  # a block: one step in each order


@dataclasses.dataclass
class RunConfig:
    arch: str
    model: ModelConfig
    batch: int
    steps: int
    lr: float = 6e-4  # nanoGPT's
    warmup: int = 20  # the learning rate's warm-up, in steps
    grad_clip: float = 1.0  # nanoGPT's; GLA in bf16 spikes without it
    seed: int = 0
    device: str = "cpu"
    control: bool = False  # also train the control run (see the module's docstring)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.device == "cuda" else None


@dataclasses.dataclass
class RunResult:
    name: str
    losses: list[float]
    tokens_per_s: float  # at the median step time of the timed steps
    step_ms: float  # the median timed step
    # GPU: torch.cuda's peak during this run's steps, less what the other runs hold; CPU: the
    # peak of what torch allocates during one training step (the profiler's memory timeline).
    # Each is taken the same way for both runs.
    peak_memory_gb: float | None
    step_seconds: list[float] = dataclasses.field(default_factory=list)  # every step's
    # The relative distance of this run's weights from the baseline's after every step.
    weight_distance: list[float] = dataclasses.field(default_factory=list)
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


@dataclasses.dataclass
class StepZero:
    """Two runs' first step from the same weights on the same batch."""

    loss_difference: float
    loss_ulp: float  # float32's spacing at the baseline's loss
    grad_difference: float  # |g - g_baseline| / |g_baseline| over all weights at once (L2)
    worst_tensor: str  # the weight whose gradient differs most, relatively
    worst_difference: float  # that weight's relative L2 difference


@dataclasses.dataclass
class Speed:
    """The fused run's tokens/s over the baseline's, per block of timed steps."""

    block_ratios: list[float]
    block_steps: int
    warm_steps: int
    # The machine's 1-minute load average over the run (min, max; None where the system does
    # not say), its cores and torch's threads: a shared machine slows both runs, not alike.
    load: tuple[float, float] | None = None
    cores: int | None = None
    threads: int | None = None
    on_cpu: bool = True

    @property
    def median(self) -> float:
        return statistics.median(self.block_ratios)

    @property
    def quartiles(self) -> tuple[float, float]:
        if len(self.block_ratios) < 2:
            return self.median, self.median
        q1, _, q3 = statistics.quantiles(self.block_ratios, n=4, method="inclusive")
        return q1, q3


@dataclasses.dataclass
class Comparison:
    baseline: RunResult
    fused: RunResult
    speed: Speed | None  # None: too few steps to time
    step_zero: StepZero
    control: RunResult | None = None
    control_step_zero: StepZero | None = None


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


def nudge_by_one_ulp(model: torch.nn.Module) -> None:
    """Move every weight to the next float32 value up: the control's perturbation."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))


class _Run:
    """One training run: its model, optimizer, compiled step, and what its steps measured."""

    def __init__(self, name: str, cfg: RunConfig, use_cce: bool, nudge: bool = False):
        self.name, self.cfg, self.use_cce = name, cfg, use_cce
        torch.manual_seed(cfg.seed)
        self.model = build(cfg.arch, cfg.model).to(cfg.device)
        if nudge:
            nudge_by_one_ulp(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.step_fn = _make_step(self.model, cfg, use_cce)
        self.rewritten = 0  # sites the pass rewrote while this run's steps compiled
        self.losses: list[float] = []
        self.seconds: list[float] = []
        self.distance: list[float] = []
        self.peak_bytes = 0
        self.first_grads: dict[str, torch.Tensor] = {}

    def resident_bytes(self) -> int:
        """What the run holds between steps: weights and optimizer state."""
        tensors = list(self.model.parameters())
        for state in self.optimizer.state.values():
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def train_step(self, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = _lr(i, self.cfg)
        cuda = self.cfg.device == "cuda"
        _sync(self.cfg.device)
        if cuda:
            others = torch.cuda.memory_allocated() - self.resident_bytes()
            torch.cuda.reset_peak_memory_stats()
        rewritten = counters["cce_compile"]["rewritten"]
        start = time.perf_counter()
        loss = self.step_fn(x, y)
        loss.backward()
        if i == 0:  # before clipping: the gradient the step computed
            self.first_grads = {
                n: p.grad.detach().clone() for n, p in self.model.named_parameters()
            }
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # a sync: the step is over
        self.seconds.append(time.perf_counter() - start)
        self.rewritten += counters["cce_compile"]["rewritten"] - rewritten
        self.losses.append(value)
        if cuda:
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated() - others)

    def tokens_per_s(self, tokens_per_step: int) -> tuple[float, float]:
        timed = self.seconds[WARM_STEPS:] if len(self.seconds) > WARM_STEPS else []
        if not timed:
            return math.nan, math.nan
        median = statistics.median(timed)
        return tokens_per_step / median, 1000 * median

    def distance_from(self, other: _Run) -> float:
        with torch.no_grad():
            mine = list(self.model.parameters())
            theirs = list(other.model.parameters())
            diff = sum(float((a - b).float().square().sum()) for a, b in zip(mine, theirs))
            norm = sum(float(b.float().square().sum()) for b in theirs)
        return math.sqrt(diff / norm)


def _step_zero(run: _Run, baseline: _Run) -> StepZero:
    mine, theirs = run.first_grads, baseline.first_grads
    per_tensor = {}
    diff = norm = 0.0
    for name, g in theirs.items():
        d = float((mine[name].double() - g.double()).square().sum())
        n = float(g.double().square().sum())
        diff, norm = diff + d, norm + n
        per_tensor[name] = math.sqrt(d / n) if n else (0.0 if d == 0 else math.inf)
    worst = max(per_tensor, key=per_tensor.get)
    loss = baseline.losses[0]
    ulp = float(torch.tensor(loss).nextafter(torch.tensor(math.inf)) - torch.tensor(loss))
    return StepZero(
        loss_difference=abs(run.losses[0] - loss),
        loss_ulp=ulp,
        grad_difference=math.sqrt(diff / norm) if norm else 0.0,
        worst_tensor=worst,
        worst_difference=per_tensor[worst],
    )


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on Windows
        return None


def _speed(baseline: _Run, fused: _Run, loads: list[float]) -> Speed | None:
    timed = len(baseline.seconds) - WARM_STEPS
    ratios = []
    for start in range(WARM_STEPS, WARM_STEPS + timed - timed % BLOCK_STEPS, BLOCK_STEPS):
        block = slice(start, start + BLOCK_STEPS)
        ratios.append(sum(baseline.seconds[block]) / sum(fused.seconds[block]))
    if not ratios:
        return None
    return Speed(
        ratios,
        BLOCK_STEPS,
        WARM_STEPS,
        load=(min(loads), max(loads)) if loads else None,
        cores=os.cpu_count(),
        threads=torch.get_num_threads(),
        on_cpu=baseline.cfg.device == "cpu",
    )


def compare(
    cfg: RunConfig,
    ids: torch.Tensor,
    progress: Callable[[int, list[_Run]], None] | None = None,
) -> Comparison:
    """Train torch.compile and cce_compile (and the control, with ``cfg.control``)
    interleaved step by step; ``progress(step, runs)`` after each step."""
    baseline = _Run("torch.compile", cfg, use_cce=False)
    fused = _Run("cce_compile", cfg, use_cce=True)
    control = _Run("control", cfg, use_cce=False, nudge=True) if cfg.control else None
    timed = [baseline, fused]
    data = batches(ids, cfg.batch, cfg.model.context, cfg.seed, cfg.device)
    loads = []
    zero = control_zero = None
    for i in range(cfg.steps):
        x, y = next(data)
        if control is not None:  # untimed, before both: whichever runs next follows it
            control.train_step(i, x, y)
        for run in timed if i % 2 == 0 else timed[::-1]:
            run.train_step(i, x, y)
        if i == 0:
            zero = _step_zero(fused, baseline)
            control_zero = None if control is None else _step_zero(control, baseline)
            for run in (baseline, fused, control):
                if run is not None:
                    run.first_grads = {}  # compared: not held through the run
        load = _load()
        if load is not None and i >= WARM_STEPS:
            loads.append(load)
        for run in (fused, control):
            if run is not None:
                run.distance.append(run.distance_from(baseline))
        if progress is not None:
            progress(i, [r for r in (baseline, fused, control) if r is not None])
    tokens = cfg.batch * cfg.model.context
    runs = [r for r in (baseline, fused, control) if r is not None]
    held = sum(r.resident_bytes() for r in runs)
    results = [_result(r, tokens, ids, others=held - r.resident_bytes()) for r in timed]
    comparison = Comparison(
        *results,
        speed=_speed(baseline, fused, loads),
        step_zero=zero,
        control_step_zero=control_zero,
    )
    if control is not None:
        comparison.control = _result(control, tokens, ids, memory=False)
    return comparison


def _result(
    run: _Run, tokens_per_step: int, ids: torch.Tensor, others: int = 0, memory: bool = True
) -> RunResult:
    """``others``: the bytes the other runs hold (GPU peaks are counted without them)."""
    cfg = run.cfg
    rate, step_ms = run.tokens_per_s(tokens_per_step)
    peak = None
    if memory and cfg.device == "cuda":
        peak = run.peak_bytes / 2**30
    elif memory:
        x, y = next(batches(ids, cfg.batch, cfg.model.context, cfg.seed + 1, cfg.device))
        peak = step_peak_bytes(lambda: run.step_fn(x, y).backward()) / 2**30
        run.model.zero_grad(set_to_none=True)
    result = RunResult(
        name=run.name,
        losses=run.losses,
        tokens_per_s=rate,
        step_ms=step_ms,
        peak_memory_gb=peak,
        step_seconds=run.seconds,
        weight_distance=run.distance,
        rewritten_sites=run.rewritten,
    )
    if memory and cfg.device == "cuda":  # the CPU demo stays short: no extra compiles
        result.loss_step_ms, result.loss_peak_memory_gb = _measure(
            run.model, cfg, run.use_cce, "forward", steps=21, others=others
        )
        result.null_step_ms, result.null_peak_memory_gb = _measure(
            run.model, cfg, run.use_cce, "null_loss", steps=21, others=others
        )
    return result


def step_peak_bytes(run: Callable[[], None]) -> int:
    """The most memory torch holds at once during ``run()`` beyond what existed before it
    (the running sum of the profiler's CPU allocation and free events, in order; works on the
    CPU, where torch keeps no allocator statistics). The same peak as the memory profiler's
    timeline of tensor creations and deletions, without building it (~3 s less per demo run)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with (
        _without_kineto_banners(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        run()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        if event.name() == "[memory]" and event.device_type() == DeviceType.CPU:
            live += event.nbytes()  # negative for a free
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
    others: int = 0,
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
    peak = _peak_gb(cfg.device)
    return 1000 * statistics.median(times), None if peak is None else peak - others / 2**30


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

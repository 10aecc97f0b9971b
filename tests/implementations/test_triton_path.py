"""The Triton implementation behind the op, end to end against the float64 oracle.

On CPU the kernels run in Triton's interpreter (small shapes); on a GPU the same tests run on
CUDA tensors. The op's dispatch is pointed at ``triton_path`` for the test's device. Fast mode's
chunks, fused or in whole rows, are ``test_triton_fast.py``'s.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from oracle import GRAD_RTOL, LOSS_RTOL, LOSS_RTOL_ROUNDED_LOGITS, Case, assert_close, oracle
from strategies import DTYPE_IDS, DTYPES, build_case, cases
from test_functional import run_and_compare as _run_and_compare

import cce_compile
from cce_compile.op import dispatch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRETING, reason="needs a GPU or TRITON_INTERPRET=1"
)


@pytest.fixture(autouse=True)
def triton_dispatch(monkeypatch):
    from cce_compile.implementations import triton_path

    monkeypatch.setattr(dispatch, "implementation_for", lambda device: triton_path)


def run_and_compare(case, mode="auto", **flags):
    """The functional comparison, with fast mode's documented precision on the GPU: its
    logits come from cuBLAS in the inputs' dtype (auto may choose fast)."""
    rounded = DEVICE == "cuda" and mode in ("fast", "auto")
    table = LOSS_RTOL_ROUNDED_LOGITS if rounded else LOSS_RTOL
    _run_and_compare(case, mode=mode, loss_rtol=table, **flags)


def to_device(case):
    for name in ("hidden", "classifier", "targets", "bias", "class_weights"):
        value = getattr(case, name)
        if value is not None:
            setattr(case, name, value.to(DEVICE))
    return case


def test_random_cases(fuzz_examples):
    @settings(
        max_examples=fuzz_examples(25),
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(cases(max_vocab=40, max_dim=36, max_rows=12))
    def check(drawn):
        case, flags = drawn
        run_and_compare(to_device(case), **flags)

    check()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_odd_shape_every_option(dtype, mode):
    # V and D not multiples of the 16-wide tiles, rows spanning several tiles, a shift.
    case = build_case(
        leading=(3, 13),
        dim=37,
        vocab=53,
        dtype=dtype,
        bias=True,
        class_weights=True,
        label_smoothing=0.1,
        softcap=12.0,
        logit_scale=1.3,
        shift=1,
        z_loss=1e-3,
        seed=3,
    )
    run_and_compare(to_device(case), mode=mode)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_return_lse_and_ignored_tiles(reduction):
    # The first rows are all ignored: whole tiles are skipped in forward and backward.
    case = build_case(leading=(2, 20), dim=20, vocab=33, reduction=reduction, seed=5)
    case.targets[0, :] = -100
    run_and_compare(to_device(case), return_lse=True, mode="lean")
    run_and_compare(to_device(case), return_lse=False, mode="lean")


def test_several_backward_slabs(monkeypatch):
    from cce_compile import policy

    monkeypatch.setattr(policy, "lean_slab_columns", lambda *args: 16)  # one tile per slab
    case = build_case(leading=(24,), dim=18, vocab=70, bias=True, label_smoothing=0.2, seed=9)
    run_and_compare(to_device(case), mode="lean")


@pytest.mark.parametrize("mode", ["lean", "fast"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["plain", "smoothing"])
def test_a_whole_program_of_classes_masked_by_a_minus_inf_bias(mode, smoothing):
    """Classes [256, 512) masked out with a -inf bias: every program (16 or 256 classes on
    the interpreter's or a GPU's tiles) that holds only them must add nothing to the lse, not
    exp(-inf - -inf) = NaN; the loss and gradients are finite, as PyTorch's."""
    case = build_case(leading=(2, 5), dim=16, vocab=600, bias=True, label_smoothing=smoothing)
    case.bias[256:512] = float("-inf")
    masked = (case.targets >= 256) & (case.targets < 512)
    case.targets[masked] = case.targets[masked] - 256  # targets on classes that count
    if smoothing:  # smoothing spreads mass over the masked classes: an infinite loss
        loss = cce_compile.linear_cross_entropy(
            to_device(case).hidden, case.classifier, case.targets, case.bias,
            label_smoothing=smoothing, mode=mode,
        )  # fmt: skip
        assert loss.item() == float("inf"), loss
    else:
        run_and_compare(to_device(case), mode=mode)


@pytest.mark.parametrize("form", ["lean", "fast", "fused"])
@pytest.mark.parametrize("shift", [0, 1])
def test_sequences_apart_in_memory_leave_the_gaps_unread(monkeypatch, form, shift):
    """hidden = base[:, :T] of a (B, T + 1, D) buffer, as a user's slice or Inductor's padded
    allocation of a slice (never written past T): the flat view of its positions took the gap
    rows as positions, and the classifier's gradient GEMM multiplied their zero gradients by
    NaN in the gap: a NaN gradient where PyTorch's is finite (an adversarial test; cde5a52)."""
    from cce_compile import policy
    from cce_compile.implementations import triton_shared

    if form == "fused":
        monkeypatch.setattr(triton_shared, "work_dtype", lambda tensor: tensor.dtype)
        monkeypatch.setattr(policy, "fast_fuses_exp", lambda problem, whole_rows: not whole_rows)
        monkeypatch.setattr(policy, "fast_run_rows", lambda *args: 5)
    case = build_case(leading=(3, 8), dim=16, vocab=40, ignored_fraction=0.0, shift=shift, seed=4)
    base = torch.full((3, 9, 16), float("nan"), dtype=case.hidden.dtype)
    base[:, :8] = case.hidden
    case.hidden = base[:, :8]
    run_and_compare(to_device(case), mode="lean" if form == "lean" else "fast")


@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_float32_inputs_with_a_bf16_compute_dtype_in_slabs(monkeypatch, mode):
    """Autocast's form: float32 hidden and classifier rounded to bf16 inside the op, the
    classifier one slab of classes at a time; float32 gradients against the oracle of the
    rounded inputs."""
    from cce_compile import policy

    monkeypatch.setattr(policy, "forward_slab_columns", lambda *args: 16)
    monkeypatch.setattr(policy, "lean_slab_columns", lambda *args: 16)
    case = build_case(
        leading=(2, 9),
        dim=24,
        vocab=61,
        bias=True,
        class_weights=True,
        label_smoothing=0.1,
        softcap=9.0,
        shift=1,
        z_loss=1e-3,
        seed=21,
    )
    case = to_device(case)
    leaves = [t.clone().requires_grad_() for t in (case.hidden, case.classifier, case.bias)]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = cce_compile.linear_cross_entropy(
            *leaves[:2], case.targets, leaves[2], mode=mode, **case.options()
        )
    grads = torch.autograd.grad(loss, leaves)
    assert all(g.dtype == torch.float32 for g in grads)
    rounded = [t.bfloat16().double().requires_grad_() for t in leaves]
    expected = oracle(Case(*rounded[:2], case.targets, bias=rounded[2], **case.options()))
    assert_close("loss", loss, expected, LOSS_RTOL_ROUNDED_LOGITS[torch.bfloat16])
    for name, got, want in zip(
        ("hidden", "classifier", "bias"), grads, torch.autograd.grad(expected, rounded)
    ):
        assert_close(name, got, want, GRAD_RTOL[torch.bfloat16])


@pytest.mark.parametrize("dim, tma", [(32, True), (37, False)], ids=["tma", "pointers"])
@pytest.mark.parametrize("layout", ["contiguous", "shift", "sliced-view", "expanded-batch"])
def test_hidden_layouts_and_load_paths(monkeypatch, dim, tma, layout):
    from cce_compile.kernels import common

    used = []
    real = common.operand_args

    def spy(*args):
        result = real(*args)
        used.append(result[2])
        return result

    monkeypatch.setattr(common, "operand_args", spy)
    for module in ("lse_forward", "logit_grad"):
        monkeypatch.setattr(f"cce_compile.kernels.{module}.operand_args", spy)
    case = build_case(leading=(3, 12), dim=dim, vocab=41, bias=True, seed=13)
    if layout == "shift":
        case.shift = 2
    elif layout == "sliced-view":  # what the graph pass feeds for logits[:, :-1] (copied)
        case.hidden = case.hidden[:, :-1]
        case.targets = case.targets[:, 1:]
    elif layout == "expanded-batch":  # stride 0: no flat matrix, the launcher copies
        case.hidden = case.hidden[:1].expand(3, -1, -1)
    run_and_compare(to_device(case), mode="lean")
    assert used and all(u == tma for u in used)


@pytest.mark.parametrize(
    "dim, heavy, elem_bytes, expected",
    [
        (512, False, 2, (128, 128, 4)),
        (2048, False, 2, (128, 128, 4)),
        (2049, False, 2, (128, 256, 8)),
        (512, True, 2, (128, 128, 8)),
        (512, False, 4, (128, 128, 8)),
    ],
    ids=["d512", "d2048-last-small", "d2049-large", "heavy-keeps-8-warps", "float32"],
)
def test_gpu_tile_choice(dim, heavy, elem_bytes, expected):
    """Which tiles a GPU launch gets (a CUDA device object needs no GPU to exist)."""
    from cce_compile.implementations import triton_shared

    config = triton_shared.tile_config(torch.device("cuda"), heavy, elem_bytes, dim=dim)
    assert (config.block_n, config.block_v, config.num_warps) == expected


@pytest.mark.parametrize(
    "dim, heavy, elem_bytes, tma, expected",
    [
        (512, False, 2, True, (128, 256, 8, 16, 3)),
        (2048, False, 2, True, (128, 256, 8, 16, 3)),
        (4096, False, 2, True, (128, 256, 8, 16, 3)),
        (2048, True, 2, True, (128, 128, 8, 8, 4)),
        (512, False, 2, False, (128, 128, 4, 8, 3)),
        (512, False, 4, True, (128, 128, 8, 8, 3)),
    ],
    ids=["d512", "d2048", "d4096", "heavy-keeps-lean-tiles", "pointer-loads", "float32"],
)
def test_gpu_fused_tile_choice(dim, heavy, elem_bytes, tma, expected):
    """The fused logits GEMM is persistent (one program per SM): wide tiles at every D where
    they fit shared memory (2-byte operands by TMA), where lean's kernels take small ones up to
    D = 2048 (two programs per SM). The wide tiles by pointers, or in float32, took 256-448 KB
    of an H200's 227 (bench/results/gpu_tests.md, cf15073)."""
    from cce_compile.implementations import triton_shared

    config = triton_shared.fused_tile_config(
        torch.device("cuda"), heavy, elem_bytes, dim=dim, tma=tma
    )
    chosen = (config.block_n, config.block_v, config.num_warps, config.group_n, config.num_stages)
    assert chosen == expected


@pytest.mark.parametrize(
    "dtype, dim, row_stride, tma",
    [
        (torch.bfloat16, 64, 64, True),
        (torch.bfloat16, 18, 18, False),
        (torch.bfloat16, 64, 68, False),
        (torch.float32, 16, 16, True),
    ],
    ids=["bf16-aligned", "bf16-rows-of-36-bytes", "bf16-strided-rows", "float32-aligned"],
)
def test_fused_tiles_follow_what_the_launcher_loads_by_tma(
    monkeypatch, dtype, dim, row_stride, tma
):
    """``fused_config_of`` asks for tiles with the TMA verdict of the operands the fused GEMM
    will read (the launcher's rule, ``operands_tma_ok``), their element size and the epilogue."""
    from cce_compile.implementations import triton_shared

    asked = []
    monkeypatch.setattr(
        triton_shared, "fused_tile_config", lambda *a, **k: asked.append((a, k)) or "tiles"
    )
    from cce_compile.implementations.interface import HeadInputs
    from cce_compile.loss_math import LossSpec

    storage = torch.zeros(10 * row_stride, dtype=dtype)
    positions = storage.as_strided((10, dim), (row_stride, 1))
    classifier = torch.zeros(40, dim, dtype=dtype)
    targets = torch.zeros(1, 10, dtype=torch.int64)
    spec = LossSpec(label_smoothing=0.1)
    head = HeadInputs(
        positions[None],
        classifier,
        targets,
        None,
        None,
        spec,
        1 << 20,
    )
    assert triton_shared.fused_config_of(head, positions, classifier) == "tiles"
    (device, heavy, elem_bytes), options = asked[0]
    assert (heavy, elem_bytes, options["tma"], options["dim"]) == (
        True,
        positions.element_size(),
        tma,
        dim,
    )


@pytest.mark.parametrize("mode", ["lean", "fast"])
@pytest.mark.parametrize(
    "leading, shift", [((0, 5), 0), ((0, 5), 1), ((3, 0), 0)], ids=["B0", "B0-shift", "T0"]
)
def test_empty_batch(leading, shift, mode):
    """No rows: a NaN mean (PyTorch's 0 / 0) and all-zero gradients, every one written."""
    case = to_device(build_case(leading=leading, dim=20, vocab=33, bias=True, shift=shift))
    for t in (case.hidden, case.classifier, case.bias):
        t.requires_grad_()
    loss = cce_compile.linear_cross_entropy(
        case.hidden, case.classifier, case.targets, case.bias, shift=shift, mode=mode
    )
    assert torch.isnan(loss)
    grads = torch.autograd.grad(loss.nan_to_num(), [case.hidden, case.classifier, case.bias])
    assert all(
        g.shape == t.shape and torch.count_nonzero(g) == 0
        for g, t in zip(grads, (case.hidden, case.classifier, case.bias))
    )

"""cce_compile.integrations.torchtitan: torchtitan 0.2.x's ``llama3_cce`` TrainSpec (CI installs
0.2.2) and torchtitan 0.3.x's ``cce_loss`` override (tested where 0.3.0 is installed).

In-process: the hook is registered on import; the fused model returns its hidden states and
the fused loss equals torchtitan's own loss on the logits (value and every gradient); what the
hook cannot serve is refused with a message. torchtitan's own trainer, 2 gloo ranks: the fused
run logs the unfused run's losses (``slow``; one layout in the suite, titan_job.SUITE_LAYOUT,
both runs in one torchrun job: ~24 s of CPU on 0.2.2; the others in titan_job.LAYOUTS are
checked by hand).
"""

from __future__ import annotations

import gc
import types

import pytest
import torch

torchtitan = pytest.importorskip("torchtitan")
if not torchtitan.__version__.startswith(("0.2.", "0.3.")):
    # (importing the integration refuses it: nothing here could run)
    pytest.skip(
        f"cce_compile.integrations.torchtitan is written for torchtitan 0.2.x and 0.3.x, "
        f"torchtitan {torchtitan.__version__} is installed",
        allow_module_level=True,
    )
import titan_job  # noqa: E402

from cce_compile.integrations import torchtitan as cce_titan  # noqa: E402

only_02 = pytest.mark.skipif(titan_job.RELEASE != "0.2", reason="torchtitan 0.2.x's TrainSpec")
only_03 = pytest.mark.skipif(titan_job.RELEASE != "0.3", reason="torchtitan 0.3.x's override")
# Fused vs unfused torchtitan runs, float32 parameters (measured: identical to the 5 printed
# digits, i.e. within one unit in the last: <= 2e-6 relative).
CURVE_RTOL = 1e-5


@pytest.mark.parametrize("version", ["0.1.0", "0.4.0", "main"])
def test_refuses_other_torchtitan_versions(version):
    with pytest.raises(
        cce_titan.TorchtitanIntegrationError, match=f"installed torchtitan {version}"
    ):
        cce_titan.check_torchtitan_version(version)


def _assert_same_loss_and_grads(fused, plain, fused_params, plain_params):
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    fused.backward()
    plain.backward()
    for name, parameter in fused_params.items():
        torch.testing.assert_close(
            parameter.grad, plain_params[name].grad, rtol=1e-4, atol=1e-6, msg=name
        )


# ------------------------------------------------------------------ 0.2.x: TrainSpec


@pytest.fixture
def no_models():
    """The 0.2 loss finds the one live FusedHead: each test starts and ends with none known."""
    cce_titan._heads.clear()
    yield
    cce_titan._heads.clear()
    gc.collect()


def _tiny_args():
    from torchtitan.models.llama3 import TransformerModelArgs

    return TransformerModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=16)


def _job(reshard="default"):
    return types.SimpleNamespace(
        parallelism=types.SimpleNamespace(fsdp_reshard_after_forward=reshard)
    )


@only_02
def test_import_registers_llama3_cce_from_torchtitans_llama3():
    from torchtitan.protocols.train_spec import get_train_spec

    fused, plain = get_train_spec("llama3_cce"), get_train_spec("llama3")
    assert fused.build_loss_fn is cce_titan.build_fused_loss
    assert issubclass(fused.model_cls, plain.model_cls)
    assert fused.parallelize_fn is plain.parallelize_fn and fused.model_args is plain.model_args
    assert cce_titan.register("llama3") == "llama3_cce"  # again: a no-op


@only_02
def test_fused_spec_loss_equals_torchtitans_loss_on_the_logits(no_models):
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Transformer
    from torchtitan.protocols.train_spec import get_train_spec

    args = _tiny_args()
    torch.manual_seed(0)
    fused_model = get_train_spec("llama3_cce").model_cls(args)
    with torch.no_grad():
        fused_model.init_weights()
    plain_model = Transformer(args)
    plain_model.load_state_dict(fused_model.state_dict())  # same FQNs, same parameters
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    labels = torch.randint(0, args.vocab_size, (2, 16))
    labels[0, :5] = -100  # torchtitan's ignore index

    hidden = fused_model(tokens)
    assert hidden.shape == (2, 16, args.dim)  # hidden states, no logits
    fused = cce_titan.build_fused_loss(_job(), parallel_dims=None)(hidden, labels)
    plain = cross_entropy_loss(plain_model(tokens), labels)
    _assert_same_loss_and_grads(
        fused, plain, dict(fused_model.named_parameters()), dict(plain_model.named_parameters())
    )


@only_02
@pytest.mark.parametrize(
    "case", ["pipeline-parallel", "reshard-after-forward-always", "no-model", "two-models"]
)
def test_fused_spec_refuses_what_it_cannot_serve(case, no_models):
    from torchtitan.protocols.train_spec import get_train_spec

    if case == "pipeline-parallel":
        with pytest.raises(cce_titan.TorchtitanIntegrationError, match="pipeline"):
            cce_titan.build_fused_loss(_job(), parallel_dims=types.SimpleNamespace(pp_enabled=True))
        return
    if case == "reshard-after-forward-always":
        with pytest.raises(cce_titan.TorchtitanIntegrationError, match="always"):
            cce_titan.build_fused_loss(_job("always"), parallel_dims=None)
        return
    model_cls, args = get_train_spec("llama3_cce").model_cls, _tiny_args()
    models = [model_cls(args) for _ in range(0 if case == "no-model" else 2)]
    loss_fn = cce_titan.build_fused_loss(_job(), parallel_dims=None)
    with pytest.raises(cce_titan.TorchtitanIntegrationError, match="one model with a FusedHead"):
        loss_fn(torch.randn(1, 4, args.dim), torch.zeros(1, 4, dtype=torch.long))
    del models


@only_02
def test_register_refuses_a_name_taken_by_another_spec(monkeypatch):
    from torchtitan.protocols import train_spec as specs

    monkeypatch.setitem(specs._extra_train_specs, "llama3_cce", specs.get_train_spec("llama3"))
    with pytest.raises(cce_titan.TorchtitanIntegrationError, match="another TrainSpec"):
        cce_titan.register("llama3")


# ------------------------------------------------------------------ 0.3.x: override


@only_03
@pytest.mark.parametrize("wrapped", [False, True], ids=["plain-loss", "chunked-loss"])
def test_cce_loss_override_replaces_torchtitans_cross_entropy(wrapped):
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss, MSELoss

    plain = CrossEntropyLoss.Config(global_vocab_size=96)
    config = ChunkedLossWrapper.Config(loss_fn=plain) if wrapped else plain
    replaced = cce_titan.cce_loss(config)
    assert type(replaced) is cce_titan.FusedLoss.Config and replaced.global_vocab_size == 96
    with pytest.raises(cce_titan.TorchtitanIntegrationError, match="MSELoss"):
        cce_titan.cce_loss(MSELoss.Config())


@only_03
def test_fused_loss_equals_torchtitans_loss_on_the_logits():
    from torchtitan.components.loss import CrossEntropyLoss

    torch.manual_seed(0)
    fused_head, plain_head = (
        torch.nn.Linear(32, 96, bias=False),
        torch.nn.Linear(32, 96, bias=False),
    )
    plain_head.load_state_dict(fused_head.state_dict())
    loss = cce_titan.FusedLoss.Config(global_vocab_size=96).build()
    loss.set_lm_head(fused_head)
    hidden = torch.randn(2, 16, 32, requires_grad=True)
    labels = torch.randint(0, 96, (2, 16))
    labels[0, :5] = -100
    tokens = (labels != -100).sum().float()
    fused, _ = loss(hidden, labels, tokens)
    assert "forward" not in fused_head.__dict__  # the head's own forward is back
    plain, _ = CrossEntropyLoss.Config(global_vocab_size=96).build()(
        plain_head(hidden.detach()), labels, tokens
    )
    _assert_same_loss_and_grads(
        fused, plain, dict(fused_head.named_parameters()), dict(plain_head.named_parameters())
    )


@only_03
def test_fused_loss_refuses_a_tensor_parallel_head():
    loss = cce_titan.FusedLoss.Config(global_vocab_size=96).build()
    loss.set_lm_head(torch.nn.Linear(32, 48, bias=False))  # a vocabulary shard
    with pytest.raises(cce_titan.TorchtitanIntegrationError, match="tensor parallelism"):
        loss(torch.randn(1, 4, 32), torch.zeros(1, 4, dtype=torch.long))


# ------------------------------------------------------------------ torchtitan's trainer


@pytest.fixture(scope="module")
def titan_workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("torchtitan")
    titan_job.write_assets(workdir)
    return workdir


@pytest.mark.slow
@pytest.mark.parametrize("layout", [titan_job.SUITE_LAYOUT])
def test_torchtitan_trainer_fused_loss_curve_equals_unfused(titan_workdir, layout):
    (unfused, unfused_log), (fused, fused_log) = titan_job.train(titan_workdir, layout)
    assert titan_job.FUSED_LOG_LINE in fused_log and titan_job.FUSED_LOG_LINE not in unfused_log
    assert len(fused) == len(unfused) == 3, (fused, unfused)
    for step, ((loss, grad_norm), (want_loss, want_norm)) in enumerate(zip(fused, unfused), 1):
        assert loss == pytest.approx(want_loss, rel=CURVE_RTOL), f"step {step} loss"
        assert grad_norm == pytest.approx(want_norm, rel=1e-3), f"step {step} grad norm"

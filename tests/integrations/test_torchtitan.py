"""cce_compile.integrations.torchtitan (torchtitan 0.2.x): the ``llama3_cce`` TrainSpec.

In-process: importing the module registers the spec; its model returns the hidden states and
its loss equals torchtitan's own loss on the logits (value and every gradient); what it cannot
serve is refused with a message. torchtitan's own trainer, 2 gloo ranks, FSDP2 and TP: the
fused run logs the unfused run's losses (``slow``; about 20 s a layout).
"""

from __future__ import annotations

import gc
import types

import pytest
import torch

torchtitan = pytest.importorskip("torchtitan")
if not torchtitan.__version__.startswith("0.2."):
    pytest.skip(f"torchtitan {torchtitan.__version__}: tests for 0.2.x", allow_module_level=True)

import titan_job  # noqa: E402
from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.models.llama3 import Transformer, TransformerModelArgs  # noqa: E402
from torchtitan.protocols.train_spec import get_train_spec  # noqa: E402

from cce_compile.integrations import torchtitan as cce_titan  # noqa: E402

TINY = TransformerModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=16)
# Fused vs unfused torchtitan runs, float32 parameters (measured: identical to the 5 printed
# digits, i.e. within one unit in the last: <= 2e-6 relative).
CURVE_RTOL = 1e-5


@pytest.fixture
def no_models():
    """The loss finds the one live FusedHead: each test starts and ends with none known."""
    cce_titan._heads.clear()
    yield
    cce_titan._heads.clear()
    gc.collect()


def _job(reshard="default"):
    return types.SimpleNamespace(
        parallelism=types.SimpleNamespace(fsdp_reshard_after_forward=reshard)
    )


def test_import_registers_llama3_cce_from_torchtitans_llama3():
    fused, plain = get_train_spec("llama3_cce"), get_train_spec("llama3")
    assert fused.build_loss_fn is cce_titan.build_fused_loss
    assert issubclass(fused.model_cls, plain.model_cls)
    assert fused.parallelize_fn is plain.parallelize_fn and fused.model_args is plain.model_args
    assert cce_titan.register("llama3") == "llama3_cce"  # again: a no-op


def test_fused_loss_equals_torchtitans_loss_on_the_logits(no_models):
    torch.manual_seed(0)
    fused_model = get_train_spec("llama3_cce").model_cls(TINY)
    with torch.no_grad():
        fused_model.init_weights()
    plain_model = Transformer(TINY)
    plain_model.load_state_dict(fused_model.state_dict())  # same FQNs, same parameters
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    labels = torch.randint(0, TINY.vocab_size, (2, 16))
    labels[0, :5] = -100  # torchtitan's ignore index

    hidden = fused_model(tokens)
    assert hidden.shape == (2, 16, TINY.dim)  # hidden states, no logits
    fused = cce_titan.build_fused_loss(_job(), parallel_dims=None)(hidden, labels)
    plain = cross_entropy_loss(plain_model(tokens), labels)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)

    fused.backward()
    plain.backward()
    plain_grads = dict(plain_model.named_parameters())
    for name, parameter in fused_model.named_parameters():
        torch.testing.assert_close(
            parameter.grad, plain_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name
        )


@pytest.mark.parametrize(
    "case",
    ["pipeline-parallel", "reshard-after-forward-always", "no-model", "two-models"],
)
def test_refuses_what_it_cannot_serve(case, no_models):
    models = []
    if case == "pipeline-parallel":
        with pytest.raises(cce_titan.TorchtitanIntegrationError, match="pipeline"):
            cce_titan.build_fused_loss(_job(), parallel_dims=types.SimpleNamespace(pp_enabled=True))
        return
    if case == "reshard-after-forward-always":
        with pytest.raises(cce_titan.TorchtitanIntegrationError, match="always"):
            cce_titan.build_fused_loss(_job("always"), parallel_dims=None)
        return
    model_cls = get_train_spec("llama3_cce").model_cls
    models = [model_cls(TINY) for _ in range(0 if case == "no-model" else 2)]
    loss_fn = cce_titan.build_fused_loss(_job(), parallel_dims=None)
    with pytest.raises(cce_titan.TorchtitanIntegrationError, match="one model with a FusedHead"):
        loss_fn(torch.randn(1, 4, TINY.dim), torch.zeros(1, 4, dtype=torch.long))
    del models


@pytest.mark.parametrize("version", ["0.1.0", "0.4.0", "main"])
def test_refuses_other_torchtitan_versions(version):
    with pytest.raises(
        cce_titan.TorchtitanIntegrationError, match=f"installed torchtitan {version}"
    ):
        cce_titan.check_torchtitan_version(version)


def test_register_refuses_a_name_taken_by_another_spec(monkeypatch):
    from torchtitan.protocols import train_spec as specs

    monkeypatch.setitem(specs._extra_train_specs, "llama3_cce", get_train_spec("llama3"))
    with pytest.raises(cce_titan.TorchtitanIntegrationError, match="another TrainSpec"):
        cce_titan.register("llama3")


@pytest.fixture(scope="module")
def titan_workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("torchtitan")
    titan_job.write_assets(workdir)
    return workdir


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(titan_job.LAYOUTS))
def test_torchtitan_trainer_fused_loss_curve_equals_unfused(titan_workdir, layout):
    unfused, unfused_log = titan_job.train(titan_workdir, layout, fused=False)
    fused, fused_log = titan_job.train(titan_workdir, layout, fused=True)
    assert titan_job.FUSED_LOG_LINE in fused_log and titan_job.FUSED_LOG_LINE not in unfused_log
    assert len(fused) == len(unfused) == 3, (fused, unfused)
    for step, ((loss, grad_norm), (want_loss, want_norm)) in enumerate(zip(fused, unfused), 1):
        assert loss == pytest.approx(want_loss, rel=CURVE_RTOL), f"step {step} loss"
        assert grad_norm == pytest.approx(want_norm, rel=1e-3), f"step {step} grad norm"

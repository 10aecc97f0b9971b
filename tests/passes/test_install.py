"""enable()/disable() on Inductor's hook, and CCE_COMPILE=1 / backend="cce" after a real install."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import sysconfig
import textwrap

import pytest
import torch
import torch.nn.functional as F
from fresh_process import INDUCTOR_WITHOUT_CODEGEN
from harness import check, hook_enabled
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import cce_compile
from cce_compile.passes.install import ChainedPass, enabled

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def restore_hook():
    """Restore Inductor's hook after each test; compile caches off, because on a cache hit
    a pre-grad pass is not called at all and these tests count calls."""
    before = inductor_config.pre_grad_custom_pass
    with (
        inductor_config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield
    cce_compile.disable()  # also restores the pass timing enable() set
    inductor_config.pre_grad_custom_pass = before


def loss(x, w, y):
    return F.cross_entropy(F.linear(x, w).view(-1, w.shape[0]).float(), y.view(-1))


def small_inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    w = torch.randn(11, 8, generator=gen, requires_grad=True)
    return x, w, torch.randint(0, 11, (2, 5), generator=gen)


def test_enable_rewrites_plain_torch_compile():
    outcome = check(loss, small_inputs(), backend="hook")
    assert outcome.rewritten == 1 and outcome.has_op


def test_enable_reports_the_rewrite_on_a_warm_cache(tmp_path, monkeypatch):
    """On torch 2.13 a pre-grad pass with a uuid runs only on a cache miss unless the timing
    is 'early', which enable() sets: the pass (and its counters, and watch()) see every
    compile, and the cached graph is the rewritten one."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._dynamo.utils import counters

    reports = []
    cce_compile.enable()
    with (
        inductor_config.patch(fx_graph_cache=True),
        torch._functorch.config.patch(enable_autograd_cache=True),
    ):
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            with cce_compile.watch() as report:
                torch.compile(loss)(*small_inputs()).backward()
            reports.append(report)
    hits = (
        counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
    )
    assert hits >= 1
    assert [len(r.rewritten) for r in reports] == [1, 1]
    assert counters["cce_compile"]["rewritten"] == 1
    cce_compile.disable()
    assert getattr(inductor_config, "pre_grad_pass_timing", "default") == "default"


def test_enable_disable_idempotent():
    inductor_config.pre_grad_custom_pass = None
    cce_compile.enable()
    cce_compile.enable()
    assert enabled() and not isinstance(inductor_config.pre_grad_custom_pass, ChainedPass)
    cce_compile.disable()
    assert not enabled() and inductor_config.pre_grad_custom_pass is None


class _UserPass(CustomGraphPass):
    def __init__(self):
        self.calls = 0

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return "user-pass-v1"


def test_composes_with_a_users_pass():
    user = _UserPass()
    inductor_config.pre_grad_custom_pass = user
    cce_compile.enable()
    chained = inductor_config.pre_grad_custom_pass
    assert isinstance(chained, ChainedPass) and chained.passes[0] is user
    assert chained.uuid() is not None
    torch._dynamo.reset()
    x, w, y = small_inputs()
    torch.compile(loss)(x, w, y)
    assert user.calls == 1
    cce_compile.disable()
    assert inductor_config.pre_grad_custom_pass is user


def test_plain_callable_user_pass_makes_the_chain_uncacheable():
    calls = []
    inductor_config.pre_grad_custom_pass = lambda graph: calls.append(graph)
    cce_compile.enable()
    assert inductor_config.pre_grad_custom_pass.uuid() is None  # Inductor then skips caching
    with hook_enabled():
        torch._dynamo.reset()
        torch.compile(loss)(*small_inputs())
    assert calls


def _parent_site_packages() -> list[str]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return sorted(p for p in paths if os.path.isdir(p))


@pytest.fixture(scope="module")
def installed_venv(tmp_path_factory) -> pathlib.Path:
    """A fresh venv with cce_compile installed from a built wheel (not editable). It sees the
    parent environment's packages (torch) as plain paths, so no .pth of the parent runs: only
    the wheel's own start-up hook can enable the pass."""
    root = tmp_path_factory.mktemp("venv")
    wheel_dir = root / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(REPO),
        ],
        check=True,
    )
    venv = root / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    site_dir = pathlib.Path(site.stdout.strip())
    (site_dir / "zz_parent_env.pth").write_text("\n".join(_parent_site_packages()) + "\n")
    wheel = next(wheel_dir.glob("*.whl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site_dir),
            str(wheel),
        ],
        check=True,
    )
    assert (site_dir / "cce_compile_autoenable.pth").exists()
    return python


# The script compiles with Inductor up to its code generation (fresh_process.py): how the pass
# gets installed is under test here, not Inductor's code for the op.
SCRIPT = textwrap.dedent(
    """
    import sys
    assert "torch" not in sys.modules, "start-up must not import torch"
    import torch, torch.nn.functional as F
    from torch._dynamo.utils import counters
    # (Inductor without code generation)

    def loss(x, w, y):
        return F.cross_entropy(F.linear(x, w).view(-1, 11), y.view(-1))

    x = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    y = torch.randint(0, 11, (2, 5))
    for name in sys.argv[1:]:  # the backends to compile with, in turn ("default": none given)
        torch._dynamo.reset()
        counters.clear()
        backend = {} if name == "default" else {"backend": name}
        compiled = torch.compile(loss, **backend)
        out = compiled(x, w, y)
        out.backward()
        torch.testing.assert_close(out, loss(x, w, y))
        print("REWRITTEN", name, counters["cce_compile"]["rewritten"])
    import cce_compile
    assert cce_compile.__file__.startswith(sys.prefix), cce_compile.__file__
    """
).replace("# (Inductor without code generation)\n", INDUCTOR_WITHOUT_CODEGEN)


def _run(python, env_extra, *args, cwd):
    # The installed wheel only: no settings, and no source tree on PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_") and k != "PYTHONPATH"}
    # A fresh compile cache: on a cache hit the pass does not run (the cached graph already
    # holds the op), and this test counts rewrites.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cwd / f"inductor-cache-{len(env_extra)}-{len(args)}")
    env.update(env_extra)
    script = cwd / "script.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [str(python), str(script), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_cce_compile_env_enables_the_pass_without_import(installed_venv, tmp_path):
    result = _run(installed_venv, {"CCE_COMPILE": "1"}, "default", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["REWRITTEN default 1"], result.stdout


@pytest.mark.slow
def test_backend_by_name_through_the_entry_point(installed_venv, tmp_path):
    """Without CCE_COMPILE, a plain torch.compile is left as it is; then backend="cce" in the
    same process (one fresh Python, not two: each costs ~12 s of CPU) is found through the
    wheel's entry point, before anything imported cce_compile, and fuses."""
    result = _run(installed_venv, {}, "default", "cce", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["REWRITTEN default 0", "REWRITTEN cce 1"], result.stdout


def test_enable_raises_a_bad_environment_setting_at_once(monkeypatch):
    """A bad value in the environment is one line at enable(), not a failure inside the first
    compile (the pass's uuid reads the settings there)."""
    from cce_compile import config

    error = config.SettingsError("CCE_MODE='turbo' is not one of auto, lean, fast")
    monkeypatch.setattr(config, "_environ_error", error)
    with pytest.raises(config.SettingsError, match="CCE_MODE='turbo'"):
        cce_compile.enable()


# The start-up hook as the repository's .pth file runs it: `python -S` (no site-packages, so no
# installed copy of the .pth runs), then site's own processing of the repository root, where
# the .pth lies (it also puts the repository's cce_compile on sys.path).
PTH_PROBE = (
    "import json, site, sys; site.addsitedir(sys.argv[1]); "
    "hook = any(getattr(f, 'name', None) == 'torch' for f in sys.meta_path); "
    "print(json.dumps([sorted(m for m in sys.modules if m.startswith('cce_compile')), hook]))"
)


def _start(**environ: str) -> tuple[list[str], bool]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_") and k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-S", "-c", PTH_PROBE, str(REPO)],
        env=env | environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "Error processing line" not in result.stderr, result.stderr
    modules, hook = json.loads(result.stdout)
    return modules, hook


def test_start_up_imports_nothing_without_a_cce_variable():
    assert _start() == ([], False)


def test_start_up_with_cce_compile_installs_the_hook():
    modules, hook = _start(CCE_COMPILE="1")
    assert "cce_compile._autoenable" in modules and "cce_compile.config" in modules and hook


@pytest.mark.parametrize("value", ["0", "off", ""])
def test_start_up_with_cce_compile_off_installs_nothing(value):
    assert _start(CCE_COMPILE=value)[1] is False


@pytest.mark.slow
def test_installed_wheel_imports_nothing_at_start_up_without_a_cce_variable(installed_venv):
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith('cce_compile')))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_") and k != "PYTHONPATH"}
    runs = {
        value: subprocess.run(
            [str(installed_venv), "-c", code],
            env=env if value is None else env | {"CCE_COMPILE": value},
            capture_output=True,
            text=True,
            timeout=60,
        )
        for value in (None, "1")
    }
    assert runs[None].stdout.strip() == "[]", runs[None].stderr
    assert "cce_compile._autoenable" in runs["1"].stdout, runs["1"].stderr


class _LossModule(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.Parameter(w.detach().clone())

    def forward(self, x, y):
        return loss(x, self.w, y)


def test_the_start_up_hook_enables_the_pass_at_the_first_torch_compile(monkeypatch):
    """CCE_COMPILE=1's hook wraps torch.compile when torch loads (here by hand, as torch is
    loaded): its first call, from model.compile() here, installs the pass and puts torch's own
    torch.compile back, and the compiled model fuses."""
    from torch._dynamo.utils import counters

    from cce_compile import _autoenable

    own = torch.compile
    monkeypatch.setattr(torch, "compile", own)  # put back after the test, whatever happens
    cce_compile.disable()
    _autoenable._wrap_compile(torch)
    assert torch.compile is not own and not enabled()
    x, w, y = small_inputs()
    model = _LossModule(w)
    torch._dynamo.reset()
    before = counters["cce_compile"]["rewritten"]
    model.compile()
    assert enabled() and torch.compile is own
    torch.testing.assert_close(model(x, y), loss(x, w, y))
    assert counters["cce_compile"]["rewritten"] == before + 1


def test_the_start_up_hook_stops_at_torch_compile_on_a_bad_setting(monkeypatch):
    """A bad setting under CCE_COMPILE=1 is a SystemExit of one line at every torch.compile
    (no `except Exception` fallback to eager swallows it), before anything compiles."""
    from cce_compile import _autoenable, config

    error = config.SettingsError("CCE_MODE='turbo' is not one of auto, lean, fast")
    monkeypatch.setattr(config, "_environ_error", error)
    monkeypatch.setattr(torch, "compile", torch.compile)
    _autoenable._wrap_compile(torch)
    for _ in range(2):
        with pytest.raises(SystemExit) as stopped:
            torch.compile(loss)
        message = str(stopped.value.code)
        assert message.startswith("cce_compile: CCE_MODE='turbo' is not one of") and (
            "\n" not in message
        )
    assert not enabled()


def test_import_torch_under_cce_compile_imports_neither_dynamo_nor_inductor():
    """The hook costs `import torch` nothing: Dynamo and Inductor load at the first compile."""
    code = (
        "import json, sys, torch; print(json.dumps([sorted(m for m in sys.modules if "
        "m.startswith(('torch._dynamo', 'torch._inductor'))), "
        "getattr(torch.compile, '_cce_enables_the_pass', False)]))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env | {"CCE_COMPILE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [[], True], result.stderr


def test_a_torch_compile_inside_the_hooks_enable_goes_through(monkeypatch):
    """Something enable() runs may call torch.compile itself: that call is handed to torch's
    own, not back into enable()."""
    from cce_compile import _autoenable
    from cce_compile.passes import install

    calls = []

    def enable_that_compiles():
        calls.append("enable")
        torch.compile(lambda x: x)

    monkeypatch.setattr(install, "enable", enable_that_compiles)
    own = torch.compile
    monkeypatch.setattr(torch, "compile", own)
    _autoenable._wrap_compile(torch)
    torch.compile(loss)
    assert calls == ["enable"] and torch.compile is own

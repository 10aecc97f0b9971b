"""Start-up hook behind ``CCE_COMPILE=1``: the pass for plain ``torch.compile``, at no cost to
``import torch``.

``cce_compile_autoenable.pth`` (installed into site-packages) imports this module at
interpreter start, and only when a ``CCE_*`` variable is set or ``TORCH_LOGS`` may name the
pass's log (the package registers it before torch reads TORCH_LOGS): without either, no process
imports cce_compile at start-up. Importing it reads the settings (no torch; a misspelt
``CCE_*`` name is reported then) and, only when CCE_COMPILE asks for the hook (CCE_COMPILE=0
does not), installs a finder that wraps ``torch.compile`` right after ``import torch``
finishes. Nothing of Dynamo or Inductor is imported then: processes that never compile
(DataLoader workers, tools) pay nothing.

The wrapper's first call runs :func:`cce_compile.enable` (which imports Inductor, as the
compile is about to) and hands over to torch's own ``torch.compile``, which it puts back.
``torch.compile(model)``, ``model.compile()``, ``torch.compiler.compile`` and the HF Trainer's
``torch_compile=True`` (through accelerate) all call ``torch.compile`` and get the pass; code
that calls Dynamo itself (``torch._dynamo.optimize``) calls ``cce_compile.enable()`` first.

With CCE_TRL (on by default) the hook also puts the op under TRL's fused LM head when
``trl.trainer.utils`` is imported (``integrations.trl.install_on_import``), so a TRL script
needs no edit either.

A bad setting, or a pass that cannot be installed, stops the program at that first
``torch.compile`` with one line on stderr (a ``SystemExit``, which no ``except Exception``
fallback to eager can swallow): a run asked to fuse never runs unfused. ``import torch`` itself
never fails, and nothing prints a traceback.
"""

from __future__ import annotations

import functools

from . import config, import_hooks


def _enable_or_exit() -> None:
    try:
        from .passes.install import enable

        enable()
    except config.SettingsError as error:
        raise SystemExit(
            f"cce_compile: {error}; the start-up hook (CCE_COMPILE) stops here rather than "
            "compile without the pass"
        ) from None
    except Exception as error:
        raise SystemExit(
            f"cce_compile: CCE_COMPILE=1 could not install the pass ({type(error).__name__}: "
            f"{error}); unset CCE_COMPILE to compile without it"
        ) from None


def _wrap_compile(torch) -> None:
    """Make torch.compile enable the pass at its first call."""
    original = torch.compile
    if getattr(original, "_cce_enables_the_pass", False):
        return
    state = "off"  # "enabling" while enable() runs: a torch.compile inside it goes through

    @functools.wraps(original)
    def compile(*args, **kwargs):
        nonlocal state
        if state == "off":
            state = "enabling"
            try:
                _enable_or_exit()
            except BaseException:
                state = "off"  # the next torch.compile stops too
                raise
            state = "on"
            if torch.compile is compile:
                torch.compile = original
        return original(*args, **kwargs)

    compile._cce_enables_the_pass = True  # type: ignore[attr-defined]
    torch.compile = compile


def install() -> None:
    """Wrap torch.compile (now, or when torch is imported) if CCE_COMPILE asks for the hook.
    A bad value, CCE_COMPILE's own included, is left for the first torch.compile to stop on."""
    if not config.auto_enable_requested():
        return
    try:
        if not config.get().auto_enable:
            return
    except config.SettingsError:
        pass
    import_hooks.after_import("torch", _wrap_compile)
    # TRL 1.16's trainers build no logits: their fused head gets the op when TRL's trainer
    # utilities load (docs/trl.md). A bad setting stops there, as at the first compile.
    try:
        serve_trl = config.get().trl
    except config.SettingsError:
        serve_trl = True
    if serve_trl:
        from .integrations.trl import install_on_import

        install_on_import()


install()

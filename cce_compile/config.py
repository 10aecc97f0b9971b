"""Settings of cce_compile: the only module that reads environment variables.

Every variable is documented in the table in README.md ("Settings"). The settings are a frozen
dataclass read once at import; code changes them with :func:`override` (a context manager, for
tests and scoped use) or :func:`update`. Nothing here imports torch, so the start-up hook that
``CCE_COMPILE=1`` installs stays cheap. A bad value is a :class:`SettingsError` whose one-line
message names the variable and its allowed values; it is raised when the settings are first
used (``get()``), never at import, so that importing torch under the start-up hook never fails
(its first torch.compile stops on it instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
from collections.abc import Iterator, Mapping

MODES = ("auto", "lean", "fast")
ESCAPE_POLICIES = ("keep", "rewrite", "drop")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class SettingsError(ValueError):
    """A setting with a value it cannot take; the message is one line."""


def _setting(variable: str, default: object, *, rewrite: bool = False):
    """A setting read from ``variable``; ``rewrite``: it changes what the graph pass emits
    (part of the pass's cache key)."""
    return dataclasses.field(default=default, metadata={"env": variable, "rewrite": rewrite})


def _rewrite(variable: str, default: object):
    """A setting that changes what the graph pass emits: part of its cache key."""
    return _setting(variable, default, rewrite=True)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What changes how the op computes and what the graph pass rewrites."""

    auto_enable: bool = _setting("CCE_COMPILE", False)
    """CCE_COMPILE: install the graph pass for plain torch.compile at its first call."""
    mode: str = _rewrite("CCE_MODE", "auto")
    """CCE_MODE: 'lean' (recompute in backward), 'fast' (gradients during forward), 'auto'."""
    memory_fraction: float = _rewrite("CCE_MEMORY_FRACTION", 0.2)
    """CCE_MEMORY_FRACTION: extra memory the loss may use, as a fraction of the logits it
    replaces (N x V x the head's dtype size; a vocabulary-parallel call gets twice it of each
    rank's share): bounds every chunk and slab, and auto picks the fastest mode that fits (see
    policy.py)."""
    memory_budget_mb: int | None = _rewrite("CCE_MEMORY_BUDGET_MB", None)
    """CCE_MEMORY_BUDGET_MB: an absolute budget in MiB that replaces the fraction (unset: the
    fraction rules)."""
    escaping_logits: str = _rewrite("CCE_ESCAPING_LOGITS", "drop")
    """CCE_ESCAPING_LOGITS: what the pass does with a loss whose logits are also used outside
    it (docs/escaping_logits.md).

    * 'drop' (default): a *training* graph (the loss needs gradients) whose logits are only
      returned (as they are, or cast to another float dtype) gets the fused loss and returns,
      in place of the logits, a ``LogitsNotComputed`` placeholder of their shape and dtype that
      holds no memory: any read of a value from it raises one error naming this setting
      (``passes/placeholder.py``). Evaluation and generation graphs (no gradient) keep their
      logits and are not warned about. Logits also used inside the graph are left alone, with
      a warning.
    * 'keep': leave every site whose logits escape alone (logged at INFO, the user's choice).
    * 'rewrite': fuse the loss anyway and keep the escaping logits (and their gradient path)
      intact: the logits' memory is not saved, the log-softmax's is.

    Why 'drop' by default: compiling the whole model (``model.compile()``, the HF Trainer's
    ``torch_compile=True``) is how most people compile, and Hugging Face models return the
    logits beside the loss, so under 'keep' that fused nothing until the user found this
    setting. The loops that run such graphs do not read the training logits: the HF Trainer
    reads ``outputs.loss`` in training (its label smoothing and ``compute_loss_func`` pop the
    labels, so the model computes no loss and there is no site: exact and unfused), TRL 1.16's
    SFTTrainer takes its metrics from its own fused LM head, accelerate's mixed-precision
    ``.float()`` and DDP's output pass-through read no value, and Liger's model patches
    already return no training logits. Code that does read them (a custom loop logging token
    accuracy from ``outputs.logits``) gets the error at its first read, never a number: the
    error names 'rewrite' and 'keep'. 'rewrite' is no default: it keeps the N x V logits, the
    memory the fused loss exists to save."""
    grad_filter: float | None = _rewrite("CCE_GRAD_FILTER", None)
    """CCE_GRAD_FILTER: gradient filtering's beta for the sites the pass rewrites (lean mode;
    filtering.py states the bound); unset: exact gradients."""
    skip_ignored: bool = _rewrite("CCE_SKIP_IGNORED", True)
    """CCE_SKIP_IGNORED: compact away the rows whose target is ignore_index before any GEMM
    (one host sync per forward to learn their count; never during CUDA-graph capture, nor on a
    GPU problem too small for it to pay: policy.MIN_SKIP_MACS)."""
    check_targets: bool = _setting("CCE_CHECK_TARGETS", False)
    """CCE_CHECK_TARGETS: on GPU, raise on targets outside [0, V) (costs a host sync)."""
    disable: bool = _rewrite("CCE_DISABLE", False)
    """CCE_DISABLE: the graph pass rewrites nothing (sites are still reported)."""
    trl: bool = _setting("CCE_TRL", True)
    """CCE_TRL: under CCE_COMPILE=1, put the op under TRL 1.16's fused LM head when TRL's
    trainer utilities are imported, for every trainer (docs/trl.md); 0 keeps TRL's kernel."""

    def __post_init__(self) -> None:
        for name in ("auto_enable", "skip_ignored", "check_targets", "disable", "trl"):
            if not isinstance(getattr(self, name), bool):
                raise SettingsError(
                    f"{_env(name)}={getattr(self, name)!r} is not a bool (setting {name!r}: "
                    "True or False; the variable: 0 or 1)"
                )
        for name, allowed in (("mode", MODES), ("escaping_logits", ESCAPE_POLICIES)):
            if getattr(self, name) not in allowed:
                raise SettingsError(
                    f"{_env(name)}={getattr(self, name)!r} is not one of {', '.join(allowed)} "
                    f"(setting {name!r})"
                )
        budget = self.memory_budget_mb
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 1
        ):
            raise SettingsError(
                f"{_env('memory_budget_mb')}={budget!r} is not an integer >= 1 "
                "(MiB; setting 'memory_budget_mb')"
            )
        beta = self.grad_filter
        if beta is not None and (
            isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0
        ):
            raise SettingsError(
                f"{_env('grad_filter')}={beta!r} is not a number in [0, 1) (a probability "
                "mass; setting 'grad_filter')"
            )
        fraction = self.memory_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not 0.0 < fraction <= 1024.0
        ):
            raise SettingsError(
                f"{_env('memory_fraction')}={fraction!r} is not a number in (0, 1024] "
                "(a fraction of the logits' bytes; setting 'memory_fraction')"
            )

    def rewrite_key(self) -> str:
        """Every setting that changes what the graph pass emits (part of the pass's uuid)."""
        return ";".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.metadata.get("rewrite")
        )


def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(Settings)}


def _env(name: str) -> str:
    """The environment variable behind a setting."""
    return _fields()[name].metadata["env"]


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name}={raw!r} is not one of 0, 1 (also: true/false, yes/no, on/off)")


def _parse(field: dataclasses.Field, raw: str) -> object:
    name = field.metadata["env"]
    if field.type == "bool":
        return _parse_bool(name, raw)
    if field.type in ("int", "int | None"):
        try:
            return int(raw.strip())
        except ValueError:
            raise SettingsError(f"{name}={raw!r} is not an integer (MiB)") from None
    if field.type in ("float", "float | None"):
        try:
            return float(raw.strip())
        except ValueError:
            raise SettingsError(f"{name}={raw!r} is not a number") from None
    return raw.strip().lower()


def from_environ(environ: Mapping[str, str]) -> Settings:
    """Settings from an environment mapping (unset or empty variables keep their defaults,
    as in ``CCE_GRAD_FILTER= python train.py``)."""
    kwargs = {
        field.name: _parse(field, environ[field.metadata["env"]])
        for field in dataclasses.fields(Settings)
        if environ.get(field.metadata["env"], "").strip()
    }
    return Settings(**kwargs)  # type: ignore[arg-type]


def mistyped_variables(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """(name, the setting's variable it is close to) for each unknown CCE_* variable that
    looks like a misspelt setting (CCE_COMPIL, CCE_MDOE). Other CCE_* names, which other
    tools may use, are not ours to judge."""
    known = [f.metadata["env"] for f in dataclasses.fields(Settings)]
    found = []
    for name in sorted(environ):
        if name.startswith("CCE_") and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            if close:
                found.append((name, close[0]))
    return found


def _warn_mistyped(environ: Mapping[str, str]) -> None:
    for name, known in mistyped_variables(environ):
        logging.getLogger("cce_compile").warning(
            "cce_compile: %s is not a setting (did you mean %s?); it is ignored. Settings: "
            "README.md, 'Settings'",
            name,
            known,
        )


def auto_enable_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Does CCE_COMPILE ask for the start-up hook? A value that is not a clear 'off' does, so
    that a mistyped one is reported rather than ignored."""
    return environ.get("CCE_COMPILE", "").strip().lower() not in _FALSE


def _from_process_environ() -> tuple[Settings, SettingsError | None]:
    try:
        return from_environ(os.environ), None
    except SettingsError as error:
        return Settings(), error


_current, _environ_error = _from_process_environ()
# Said once per process, at its first import of cce_compile (at every interpreter start where
# the start-up hook is installed), so that a misspelt variable is not silently ignored.
_warn_mistyped(os.environ)


def torch_logs_names_cce(environ: Mapping[str, str] = os.environ) -> bool:
    """Does TORCH_LOGS name the pass's log (``cce``, ``+cce``)? (The package registers the
    name then, before torch reads TORCH_LOGS: ``cce_compile/__init__.py``.)"""
    names = environ.get("TORCH_LOGS", "").split(",")
    return any(name.strip().lstrip("+-") == "cce" for name in names)


def get() -> Settings:
    """The settings in force now; raises SettingsError if the environment held a bad value."""
    if _environ_error is not None:
        raise _environ_error
    return _current


def update(**changes: object) -> Settings:
    """Change settings for the rest of the process; returns the previous settings."""
    global _current
    if changes.get("auto_enable") and not _current.auto_enable:
        # Read by the start-up hook only: setting it in code installs nothing.
        logging.getLogger("cce_compile").warning(
            "cce_compile: setting 'auto_enable' (CCE_COMPILE) is read by the start-up hook when "
            "the interpreter starts; setting it in code installs nothing: call "
            "cce_compile.enable() (or use backend='cce')"
        )
    previous = get()
    _check_names(changes)
    _current = dataclasses.replace(previous, **changes)  # type: ignore[arg-type]
    return previous


def _check_names(changes: Mapping[str, object]) -> None:
    """A SettingsError naming a keyword that is no setting (as a mistyped variable is named)."""
    known = [field.name for field in dataclasses.fields(Settings)]
    for name in changes:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SettingsError(f"{name!r} is not a cce_compile setting{hint}; settings: {known}")


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Settings]:
    """Change settings inside a ``with`` block and restore them after, even on error."""
    global _current
    previous = update(**changes)
    try:
        yield _current
    finally:
        _current = previous

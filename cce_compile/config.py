"""Settings of cce_compile: the only module that reads environment variables.

Every variable is documented in the table in README.md ("Settings"). The settings are a frozen
dataclass read once at import; code changes them with :func:`override` (a context manager, for
tests and scoped use) or :func:`update`. Nothing here imports torch, so the start-up hook that
``CCE_COMPILE=1`` installs stays cheap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping

MODES = ("auto", "lean", "fast")
ESCAPE_POLICIES = ("keep", "rewrite")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _rewrite(default: object):
    """A setting that changes what the graph pass emits: part of its cache key."""
    return dataclasses.field(default=default, metadata={"rewrite": True})


@dataclasses.dataclass(frozen=True)
class Settings:
    """What changes how the op computes and what the graph pass rewrites."""

    auto_enable: bool = False
    """CCE_COMPILE: install the graph pass for plain torch.compile at `import torch`."""
    mode: str = _rewrite("auto")
    """CCE_MODE: 'lean' (recompute in backward), 'fast' (gradients during forward), 'auto'."""
    memory_budget_mb: int = _rewrite(4096)
    """CCE_MEMORY_BUDGET_MB: extra memory the loss may use: fast mode's accumulator and chunk,
    the CPU path's chunk, and auto's limit for choosing fast mode."""
    escaping_logits: str = _rewrite("keep")
    """CCE_ESCAPING_LOGITS: 'keep' leaves a site whose logits escape alone; 'rewrite' fuses
    the loss anyway and keeps the escaping logits (and their gradient path) intact."""
    check_targets: bool = False
    """CCE_CHECK_TARGETS: on GPU, raise on targets outside [0, V) (costs a host sync)."""
    disable: bool = _rewrite(False)
    """CCE_DISABLE: the graph pass rewrites nothing (sites are still reported)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.escaping_logits not in ESCAPE_POLICIES:
            raise ValueError(
                f"escaping_logits must be one of {ESCAPE_POLICIES}, got {self.escaping_logits!r}"
            )
        if self.memory_budget_mb < 1:
            raise ValueError(f"memory_budget_mb must be >= 1, got {self.memory_budget_mb}")

    def rewrite_key(self) -> str:
        """Every setting that changes what the graph pass emits (part of the pass's uuid)."""
        return ";".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.metadata.get("rewrite")
        )


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be 0 or 1, got {raw!r}")


def from_environ(environ: Mapping[str, str]) -> Settings:
    """Settings from an environment mapping (unset variables keep their defaults)."""
    kwargs: dict[str, object] = {}
    for name, field in (
        ("CCE_COMPILE", "auto_enable"),
        ("CCE_CHECK_TARGETS", "check_targets"),
        ("CCE_DISABLE", "disable"),
    ):
        if name in environ:
            kwargs[field] = _parse_bool(name, environ[name])
    if "CCE_MODE" in environ:
        kwargs["mode"] = environ["CCE_MODE"].strip().lower()
    if "CCE_ESCAPING_LOGITS" in environ:
        kwargs["escaping_logits"] = environ["CCE_ESCAPING_LOGITS"].strip().lower()
    if "CCE_MEMORY_BUDGET_MB" in environ:
        try:
            kwargs["memory_budget_mb"] = int(environ["CCE_MEMORY_BUDGET_MB"])
        except ValueError:
            raise ValueError(
                f"CCE_MEMORY_BUDGET_MB must be an integer, got {environ['CCE_MEMORY_BUDGET_MB']!r}"
            ) from None
    return Settings(**kwargs)  # type: ignore[arg-type]


_current = from_environ(os.environ)


def get() -> Settings:
    """The settings in force now."""
    return _current


def update(**changes: object) -> Settings:
    """Change settings for the rest of the process; returns the previous settings."""
    global _current
    previous = _current
    _current = dataclasses.replace(_current, **changes)  # type: ignore[arg-type]
    return previous


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Settings]:
    """Change settings inside a ``with`` block and restore them after, even on error."""
    global _current
    previous = update(**changes)
    try:
        yield _current
    finally:
        _current = previous

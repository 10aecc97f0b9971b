"""The implementation version: a hash of the sources that define what the ops compute, and of
the pass that puts them in graphs.

PyTorch's AOTAutograd and FX graph caches key a custom op by its name and arguments only, not
by its autograd formula or kernels. Every caller passes ``IMPLEMENTATION_VERSION`` as the op's
last argument, so an upgrade of cce_compile misses the caches instead of replaying a backward
graph traced from old code, and a stale graph that reaches the op fails loudly.
"""

from __future__ import annotations

import hashlib
import pathlib

_PACKAGE = pathlib.Path(__file__).parent.parent
# What defines the ops: these folders, and the package's top-level modules but those below
# (the public function and the graph pass's plumbing do not change what the op computes).
# The pass is in: what a rewritten graph saves for its backward rests on node tags that the
# caches' keys (the graph's code) do not see.
_OP_FOLDERS = ("op", "implementations", "kernels", "passes")
_NOT_OP_SOURCES = {"compile_backend.py", "_autoenable.py", "__init__.py", "functional.py"}


def op_sources() -> list[pathlib.Path]:
    """The files that define the ops: their math, kernels, dispatch and autograd."""
    files = [p for p in sorted(_PACKAGE.glob("*.py")) if p.name not in _NOT_OP_SOURCES]
    for folder in _OP_FOLDERS:
        files += sorted((_PACKAGE / folder).glob("*.py"))
    return files


def source_hash(paths: list[pathlib.Path], seed: bytes = b"") -> int:
    """A 31-bit hash of ``seed`` and the files' bytes."""
    digest = hashlib.sha256(seed)
    for path in paths:
        digest.update(path.read_bytes())
    return int.from_bytes(digest.digest()[:4], "little") & 0x7FFFFFFF


IMPLEMENTATION_VERSION = source_hash(op_sources())


def check(
    version: int, *, expected: int = IMPLEMENTATION_VERSION, op: str = "cce::linear_cross_entropy"
) -> None:
    """Raise if a graph built by another cce_compile calls the op."""
    if version != expected:
        raise RuntimeError(
            f"{op} was called with implementation_version {version}, this cce_compile is "
            f"{expected}: a stale compiled graph; clear the torch.compile caches "
            "(TORCHINDUCTOR_CACHE_DIR)"
        )

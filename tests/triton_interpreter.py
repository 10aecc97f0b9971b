"""Triton's interpreter (TRITON_INTERPRET=1, the kernels on CPU) with its language patching cached.

At every kernel launch, and at every call of a ``@triton.jit`` helper inside a running kernel,
the interpreter swaps triton.language's builtins for interpreted ones (``_patch_lang``), listing
every member of each language module with ``inspect.getmembers`` to find them: ~30% of an
interpreted kernel's time at the tests' sizes (the row and tile loops call helpers per program).
Which members are builtins never changes, so ``list_builtins_once`` lists them once per module;
each call still patches exactly what the interpreter's own function would (a member that is no
longer a builtin, because an enclosing call patched it, is left as it is, as there).

Applied by conftest.py where the interpreter runs; a Triton whose interpreter differs from the
one this was written for (3.9: ``_patch_builtin(pkg, builder, scope)``) is left alone.
"""

from __future__ import annotations

import inspect


def list_builtins_once() -> bool:
    """Installs the cached listing; False (nothing changed) on an interpreter it does not know."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_builtin = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if patch_builtin is None or patch_attr is None:
        return False
    if list(inspect.signature(patch_builtin).parameters) != ["pkg", "builder", "scope"]:
        return False
    is_builtin = tl.core.is_builtin
    builtin_names: dict[int, list[str]] = {}

    def cached_patch_builtin(pkg, builder, scope):
        names = builtin_names.get(id(pkg))
        if names is None:  # the first launch that patches ``pkg`` lists it unpatched
            names = [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
            builtin_names[id(pkg)] = names
        for name in names:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = cached_patch_builtin
    return True

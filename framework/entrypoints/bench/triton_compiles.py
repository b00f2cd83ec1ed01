"""Count the compiled variants of mrv2's Triton kernels, to show that a timed run compiled nothing.

Triton compiles a kernel once per distinct set of constexpr values and argument specialisations. A size that
changes from step to step and reaches a kernel as a constexpr (or a specialised int) would compile a new variant
in the middle of serving: seconds of stall. Kernels mark such sizes `do_not_specialize`; `mrv2 bench` warms up
and then reports any compile that still happened during the timed run.
"""

from __future__ import annotations

import sys

_PACKAGES = ("framework.", "samplers.", "speculators.", "model_states.")


def compiled_variants() -> dict[str, int]:
    """Kernel name -> number of compiled variants (over all devices) of every loaded mrv2 Triton kernel.

    Empty under `TRITON_INTERPRET=1` (nothing is compiled) and without Triton.
    """
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}
    counts: dict[str, int] = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(_PACKAGES):
            continue
        for value in list(vars(module).values()):
            if not isinstance(value, JITFunction):
                continue
            key = f"{value.fn.__module__}.{value.fn.__name__}"  # where it is defined, whoever imported it
            caches = getattr(value, "device_caches", {})  # device -> (kernel_cache, ...)
            counts[key] = sum(len(entry[0]) for entry in caches.values())
    return counts


def new_variants(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Kernels that compiled variants between two `compiled_variants()` snapshots, with how many."""
    return {name: n - before.get(name, 0) for name, n in sorted(after.items()) if n > before.get(name, 0)}


__all__ = ["compiled_variants", "new_variants"]

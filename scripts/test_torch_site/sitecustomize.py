"""Put first on PYTHONPATH by scripts/test_torch.sh only (every process of a test run, gloo
ranks included, imports it): a test-harness fix of one torch bug, never loaded by Slapo.

torch 2.11's meta function of `aten._scaled_dot_product_flash_attention_for_cpu` declares a
float32 logsumexp whatever the inputs; the CPU kernel returns float64 for float64 inputs
(2.13's meta returns the computation dtype). Every float64 SDPA inside an inductor- or
aot_eager-compiled block on CPU then fails in the backward ("expected scalar type Double but
found Float"), which stopped the float64 equivalence tests of compiled blocks on torch 2.11
before they compared anything (they found a real torch-2.11 gradient loss once run:
docs/runtime.md, "torch versions"). CPU float64 only: the GPU's kernels and fp32/bf16 are
untouched. The fix is applied right after `import torch` (a one-shot import hook), and only
where torch's meta really returns float32 for float64.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings


def _fix_cpu_flash_attention_meta(torch) -> None:
    from torch._C import DispatchKey
    from torch._decomp import global_decomposition_table

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    orig = global_decomposition_table["meta"].get(op)
    if orig is None:
        return
    q = torch.empty(1, 1, 2, 8, dtype=torch.float64, device="meta")
    if orig(q, q, q)[1].dtype == torch.float64:  # this torch is right
        return

    def meta(query, *args, **kwargs):
        out, lse = orig(query, *args, **kwargs)
        return out, (lse.to(torch.float64) if query.dtype == torch.float64 else lse)

    global_decomposition_table["meta"][op] = meta
    op.py_kernels[DispatchKey.Meta] = meta
    op._dispatch_cache.clear()


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Runs the fix once `torch` has finished importing, then leaves `sys.meta_path`."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader.exec_module

        def exec_module(module):
            inner(module)
            try:
                _fix_cpu_flash_attention_meta(module)
            except Exception as e:  # noqa: BLE001  (a harness fix: warn, never fail the import)
                warnings.warn(f"scripts/test_torch_site: meta fix not applied: {e!r}",
                              stacklevel=2)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterTorch())

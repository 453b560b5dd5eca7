"""Test and CPU-demo support: megatron-core on CPU/gloo and multi-rank helpers.

Never imported by product code. Modules: :mod:`.cpu` (the CPU adapter), :mod:`.multirank`
(forked gloo ranks), :mod:`.models` (tiny GPT chunks with split-independent weights).
"""

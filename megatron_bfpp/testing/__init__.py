"""Test support: multi-rank helpers and tiny models. Never imported by product code.

Modules: :mod:`.multirank` (forked gloo ranks with megatron-core's parallel state, on the
product's local launcher :mod:`megatron_bfpp.local_ranks`), :mod:`.models` (tiny GPT chunks with
split-independent weights, reference runs, gradient comparison). The CPU adapter they enable is
product code: :mod:`megatron_bfpp.megatron.cpu`.
"""

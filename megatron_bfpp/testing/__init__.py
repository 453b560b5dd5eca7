"""Test support: multi-rank helpers and tiny models. Never imported by product code.

Modules: :mod:`.multirank` (forked gloo ranks with megatron-core's parallel state, on the
product's local launcher :mod:`megatron_bfpp.local_ranks`), :mod:`.models` (tiny GPT chunks with
split-independent weights, reference runs, gradient comparison), :mod:`.nccl_emulation` (NCCL's
point-to-point rules on gloo, so an order that would deadlock on NCCL fails in the tests; installed
in every rank under ``BFPP_NCCL_EMULATION=1``, which ``tests/conftest.py`` sets). The CPU
adapter they enable is product code: :mod:`megatron_bfpp.megatron.cpu`.
"""

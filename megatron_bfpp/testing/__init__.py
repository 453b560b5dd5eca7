"""Test support: multi-rank helpers and tiny models. Never imported by product code.

:mod:`.multirank` (forked gloo ranks on :mod:`megatron_bfpp.local_ranks`), :mod:`.models` (tiny
GPT chunks with split-independent weights), :mod:`.nccl_emulation` (NCCL's point-to-point rules on
gloo, installed under ``BFPP_NCCL_EMULATION=1``, which ``tests/conftest.py`` sets). The CPU
adapter they enable is product code: :mod:`megatron_bfpp.megatron.cpu`.
"""

"""bfpp-train's own trainer on megatron-core, apart from the Megatron-LM plugin.

:mod:`.trainer` runs one rank's loop; :mod:`.checkpoint_metadata` and :mod:`.checkpoint_files`
are torch-free, so the command line (:mod:`megatron_bfpp.cli.train`) reads a checkpoint before
any rank starts; local ranks come from :mod:`megatron_bfpp.local_ranks`.
"""

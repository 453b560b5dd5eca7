"""bfpp-train's own trainer on megatron-core, apart from the Megatron-LM plugin.

Modules: :mod:`.trainer` (one rank's training loop), :mod:`.presets` (GPT / LLaMA configs, model
chunks, split-independent initialisation, DDP wrapping), :mod:`.steps` (Megatron-LM's loss and
forward step), :mod:`.data` (deterministic data), :mod:`.checkpoint` (save / resume). The
command line is :mod:`megatron_bfpp.cli.train`; its local ranks come from
:mod:`megatron_bfpp.local_ranks`.
"""

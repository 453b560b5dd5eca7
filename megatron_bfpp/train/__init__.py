"""bfpp-train's own trainer on megatron-core, apart from the Megatron-LM plugin.

Modules: :mod:`.trainer` (one rank's training loop), :mod:`.presets` (GPT / LLaMA configs, model
chunks, split-independent initialisation, DDP wrapping), :mod:`.steps` (Megatron-LM's loss and
forward step), :mod:`.data` (deterministic data), :mod:`.checkpoint` (save / resume), and the
torch-free modules the command line reads a checkpoint with before any rank starts:
:mod:`.run_config` (what a run is), :mod:`.checkpoint_metadata` (what a checkpoint records, the
resume rules) and :mod:`.checkpoint_files` (tracker, temporary directories, atomic publish). The
command line is :mod:`megatron_bfpp.cli.train`; its local ranks come from
:mod:`megatron_bfpp.local_ranks`.
"""

"""bfpp-train's own trainer on megatron-core (:mod:`.trainer`), apart from the Megatron-LM plugin;
its checkpoint metadata and files are torch-free, so the command line reads them before any rank."""

"""What a run is and what its model weighs, torch-free (``run_config``, ``model_memory``): a layer
below the planner so that the planner and the trainer both read it (docs/architecture.md#layers)."""

"""What a run is and what its model weighs, torch-free: ``run_config`` (the model, the parallel
layout, the training settings and learning-rate schedule a run's flags imply) and
``model_memory`` (parameters, gradients and Adam state per rank). A layer of its own below the
planner, so that the planner and the trainer both read it and neither imports the other to get
it (docs/architecture.md#layers)."""

"""plan: validate the config, build and analyse the model, and choose the parallel layout, before any process group exists."""

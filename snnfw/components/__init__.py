"""The parts a run is assembled from: optimizer, loss, precision, metrics, checkpoints, weights and exports."""

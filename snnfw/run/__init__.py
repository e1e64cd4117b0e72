"""apply and run: the parallelized trainer, the Python API session and the training loop every rank executes."""

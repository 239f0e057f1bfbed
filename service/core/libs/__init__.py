"""What the libraries a training step runs through do, one module per library: the facts both
the estimator and the allocator schedule read."""

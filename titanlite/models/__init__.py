"""Model definitions. Nothing here knows about parallelism or the training loop."""

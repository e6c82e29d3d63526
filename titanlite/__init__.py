"""titanlite: a small, readable LLM pretraining codebase on PyTorch composable parallelism."""

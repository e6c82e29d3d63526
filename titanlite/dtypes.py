"""The floating-point dtypes a config may name, by their config spelling."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

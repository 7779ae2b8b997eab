"""The dtypes the config names (training.mixed_precision_param and _reduce, checkpoint.export_dtype), by name."""

import torch

# Dtype names as the config spells them.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

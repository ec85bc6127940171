"""The floating-point dtypes by the names a job's config (`training.mixed_precision_*`, `checkpoint.export_dtype`)
and the scripts' flags use: one map for all of them."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

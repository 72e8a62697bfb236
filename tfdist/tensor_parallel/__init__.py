"""Operator-level model parallelism: layers whose weights are split over a process's devices,
equal to the unsplit Keras layers in outputs and gradients.

* `ColumnParallelDense` / `RowParallelDense` (`dense.py`): one Dense kernel split by output units
  / input features (Megatron-LM); a column layer with `gather_output=False` followed by a row
  layer with `input_is_parallel=True` is Megatron's MLP, one sum and no gather between.
"""

from tfdist.devices import on_device
from tfdist.tensor_parallel.dense import ColumnParallelDense, RowParallelDense

__all__ = ["ColumnParallelDense", "RowParallelDense", "on_device"]

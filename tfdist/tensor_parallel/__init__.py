"""Operator-level model parallelism: layers whose weights are split over a process's devices,
equal to the unsplit Keras layers in outputs and gradients. Each takes an unsplit layer's weights
with `load_from(layer)` and serializes like any Keras layer.

* `ColumnParallelDense` / `RowParallelDense` (`dense.py`): one Dense kernel split by output units
  / input features (Megatron-LM); a column layer with `gather_output=False` followed by a row
  layer with `input_is_parallel=True` is Megatron's MLP, one sum and no gather between.
* `ParallelConv2D` (`conv.py`): one Conv2D kernel split by filters (`split="output"`) or by input
  channels (`split="input"`), chained the same way.
* `ParallelMultiHeadAttention` (`attention.py`): the heads split, one sum forward and one
  backward.
* `ParallelTransformerBlock` (`transformer.py`): attention and MLP both split; equal to
  `transformer_block`, the same block of plain Keras layers.
* `ParallelBranches` (`branches.py`): the parallel branches of a block (Inception-style), each on
  a device of its own.
"""

from tfdist.devices import on_device
from tfdist.tensor_parallel.attention import ParallelMultiHeadAttention
from tfdist.tensor_parallel.branches import ParallelBranches
from tfdist.tensor_parallel.conv import ParallelConv2D
from tfdist.tensor_parallel.dense import ColumnParallelDense, RowParallelDense
from tfdist.tensor_parallel.transformer import ParallelTransformerBlock, transformer_block

__all__ = ["ColumnParallelDense", "ParallelBranches", "ParallelConv2D",
           "ParallelMultiHeadAttention", "ParallelTransformerBlock", "RowParallelDense",
           "on_device", "transformer_block"]

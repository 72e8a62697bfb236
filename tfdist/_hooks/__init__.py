"""Every private TensorFlow / Keras touch of tfdist, one concept per module, each covered by
tests/test_hooks.py (which fails first if an upgrade moves one). Pinned: tensorflow 2.21.x,
keras 3.15.x.

* `optimizer`: Keras optimizer internals (the gradient all-reduce, the strategy hooks, variable
  indices, instance patches, slot placement);
* `distribute`: tf.distribute internals (collective keys, the merge-call query);
* `checkpoint`: checkpoint entries computed at save time, objects hidden from a checkpoint;
* `profiler`: where and when a function's ops ran (run metadata, the profiler's trace);
* `training`: Keras `fit` internals (the epoch a resumed `fit` starts from, the per-step
  reduction of the logs over workers).
* `variables`: Keras variable and layer internals (storage released for ZeRO stage 3, a layer's
  own variables, nested layers, symbolic shape inference, the autocast scope, uncast reads).
* `graphs`: the gradient registry (custom gradients that TensorFlow registers while tracing and
  never drops, released after a block of work).
* `coordination`: the coordination service's key-value store of a multi-worker job.
* `imports`: Keras' import of matplotlib (loaded on first use instead of at every start-up).
"""

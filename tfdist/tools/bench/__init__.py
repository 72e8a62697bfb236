"""`tfdist bench`: the benchmark suites.

* `suites`: engines, compression, local_sgd, memory and pipeline (one process each);
* `comm`: the algorithm x link sweep on the emulated multi-host cluster;
* `collectives`: one all-reduce over tf.distribute's collectives and Horovod's Gloo;
* `processes`: the multi-process rows' launcher (TF_CONFIG workers or Horovod ranks);
* `pipeline`: the pipeline suite's measurements (step time, idle fractions from a profiler trace,
  activation memory).
"""

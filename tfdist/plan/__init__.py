"""Before the cluster exists: each algorithm's predicted step time, bytes and memory per device
at 8 to 1,024 workers, and the one to use (`tfdist plan` on the command line).

The cost model is the one `AutoExchange` decides with during training (`tfdist.plan.costs`),
in plain arithmetic: this package's modules import no TensorFlow (the `tfdist plan` command
loads none when the compute step is given; `import tfdist.plan` loads it with the `tfdist`
package, which registers its Keras classes). `simulate` plays stragglers and
asynchronous training (parameter servers, bounded staleness, local SGD) event by event.

Example:
    ```python
    from tfdist.plan import Cluster, Link, Workload, predict

    plan = predict(Workload.from_parameters(5_483_530, compute_s=0.05),
                   Cluster(workers=8, link=Link(gbit_per_s=1)))
    print(plan.table())
    print("use", plan.best.algorithm, "-", plan.reason)
    ```
"""

from tfdist.plan.costs import STEPS_FACTORS
from tfdist.plan.planner import (
                                 DEFAULT_ALGORITHMS,
                                 SPEC_HELP,
                                 Calibration,
                                 Cluster,
                                 Estimate,
                                 Link,
                                 Plan,
                                 Workload,
                                 embedding_rows,
                                 predict,
)
from tfdist.plan.simulate import (
                                  Simulation,
                                  Stragglers,
                                  simulate,
)

__all__ = ["DEFAULT_ALGORITHMS", "SPEC_HELP", "STEPS_FACTORS", "Calibration", "Cluster",
           "Estimate", "Link", "Plan", "Simulation", "Stragglers", "Workload",
           "embedding_rows", "predict", "simulate"]

"""A parameter server for one worker, in its own process (a server's RPC handlers run Python
and cannot share a process with a worker's client): `python -m tests.workers.ps_server PORT
[COMPRESSOR [SETUP]]` serves `tests.test_ps._model()`'s variables with Adam(0.05) until the
worker is done, the pushes compressed with COMPRESSOR (a name; "None" or absent: none), the
workers held to SETUP (a JSON mapping of texts; absent: none)."""

import json
import sys

import keras

from tests.test_ps import LEARNING_RATE, _model
from tfdist import compression
from tfdist.ps import ParameterServer
from tfdist.security import job_secret

if __name__ == "__main__":
    port = int(sys.argv[1])
    name = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] != "None" else None
    setup = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    server = ParameterServer(_model().trainable_variables, keras.optimizers.Adam(LEARNING_RATE), 1,
                             compressor=compression.get(name), min_compress_size=0, setup=setup)
    print(json.dumps(server.serve(f"127.0.0.1:{port}", job_secret())), flush=True)

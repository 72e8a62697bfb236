"""A parameter server for one worker, in its own process (a server's RPC handlers run Python
and cannot share a process with a worker's client): `python ps_server.py PORT STALENESS`
serves `tests.test_ps._model()`'s variables with Adam(0.05) until the worker is done."""

import json
import sys

import keras

from tests.test_ps import LEARNING_RATE, _model
from tfdist.ps import ParameterServer

if __name__ == "__main__":
    port = int(sys.argv[1])
    server = ParameterServer(_model().trainable_variables, keras.optimizers.Adam(LEARNING_RATE), 1)
    print(json.dumps(server.serve(f"127.0.0.1:{port}")), flush=True)

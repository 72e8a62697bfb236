"""Data for `tfdist train --set data.name=tests.workers.nan_data:digits_with_a_nan`: the digits
set with one training example made of NaNs."""

from __future__ import annotations

import numpy as np

from tfdist.data import load_digits


def digits_with_a_nan(seed: int = 0):
    (x, y), test = load_digits("train", 0.2, seed), load_digits("test", 0.2, seed)
    x = np.array(x, copy=True)
    x[5] = np.nan
    return (x, y), test

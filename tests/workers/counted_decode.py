"""data.decode for the digits record set that leaves a trace of every record it decodes, on
the host that decodes it: an empty file in /tmp/decoded (each emulated host's own /tmp) named
by the record's fingerprint and a random number. TensorFlow ops only, so it also runs on the
tf.data service's data workers."""

import tensorflow as tf

from tfdist.data.records import decode_example

_DIGITS = decode_example({"x": {"dtype": "float32", "shape": [8, 8, 1]},
                          "y": {"dtype": "int32", "shape": []}})


def fingerprint(record) -> tf.Tensor:
    """The record's fingerprint, as the trace's file name starts."""
    return tf.strings.as_string(tf.strings.to_hash_bucket_fast(record, 2**62))


def decode(record):
    name = tf.strings.join(["/tmp/decoded/", fingerprint(record), "-",
                            tf.strings.as_string(tf.random.uniform([], 0, 2**62, tf.int64))])
    with tf.control_dependencies([tf.io.write_file(name, "")]):
        x, y = _DIGITS(record)
        return tf.identity(x), tf.identity(y)

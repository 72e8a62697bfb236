"""data.decode for the digits record set that leaves a trace of every record it decodes, on
the host that decodes it: an empty file in /tmp/decoded (each emulated host's own /tmp) named
by the record's fingerprint (`tfdist.tools.bench.input.traced`)."""

from tfdist.data.records import decode_example
from tfdist.tools.bench.input import DIGITS, traced

decode = traced(decode_example(DIGITS), "/tmp/decoded")

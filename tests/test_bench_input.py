"""The input suite (`tfdist bench --suite input`): its resume rows count what each way of
reading reads, and its table and plot are made from its rows."""

from __future__ import annotations

from tfdist.tools.bench import input as suite
from tfdist.tools.bench import plots


def test_the_resume_rows_count_what_a_record_set_and_a_stream_read(tmp_path):
    """Resumed at global batch 200, the stream reads the 12,800 records before it; the record
    set reads only the few batches around its first."""
    path = suite._records(tmp_path)
    rows = suite.resume_rows(path, (0, 200), progress=lambda text: None)
    later = rows[1]
    assert later["start"] == 200 and later["stream_read"] >= 200 * suite.BATCH
    assert later["records_read"] <= 8 * suite.BATCH
    assert rows[0]["records_read"] <= 8 * suite.BATCH
    result = {"batch": suite.BATCH, "epochs": 1, "rows": rows + [
        {"kind": "reads", "workers": 2, "trained": 1408, "read": 760, "share": 760 / 1408},
        {"kind": "step", "input": "record set", "step_ms": 2.5, "decode_ms_per_record": None},
        {"kind": "service", "input": "through the tf.data service", "trained": 4224,
         "trainers_decoded": 1, "data_decoded": 7962, "step_ms": 6.26, "test_accuracy": 0.8886},
        {"kind": "format", "format": "ArrayRecord", "record_bytes": 3072, "records": 5000,
         "per_s": 12345.6, "write_s": 0.5, "mb": 15.7},
        {"kind": "order", "examples": 50_000_000, "way": "keyed", "first_s": 0.304,
         "per_s": 8035.2, "mb": 17.2}]}
    table = suite.page_table(result)
    assert "| 2 | 1,408 | 760 | 54.0% |" in table and "| 200 |" in table
    assert "| record set | 2.5 ms |  |" in table
    assert "| through the tf.data service | 4,224 | 1 | 7,962 | 6.3 ms | 0.8886 |" in table
    assert "5,000 records of 3,072 bytes" in table and "| ArrayRecord | 12,346 | 0.50 s | 15.7 MB |" \
        in table
    assert "| 50,000,000 | each batch's computed alone | 0.30 s | 8,035 | 17 MB |" in table
    png = plots.input_suite(result["rows"], tmp_path / "input.png")
    assert png.read_bytes()[:4] == b"\x89PNG"

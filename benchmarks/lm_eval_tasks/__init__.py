"""lm-evaluation-harness tasks over JSONL shipped in benchmarks/data, and the scripts around their runs."""

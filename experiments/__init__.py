"""Studies, reports and benchmarks (``python -m experiments.<name>``)."""

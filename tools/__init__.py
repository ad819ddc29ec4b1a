"""Operator tools: the CLI, the control client, export/gc/check and benchmarks."""

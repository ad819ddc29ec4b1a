"""Operator tools: the CLI, the control client, export/gc/check; benchmarks in bench/."""

"""Programs that exercise the library: the CLI, the demo, the stress tool, the benchmarks."""

"""Developer tools: benchmarks (tools/bench/) and utilities; see tools/README.md. Not part of the installed package."""

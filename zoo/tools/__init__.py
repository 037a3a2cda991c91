"""Tools: the memory planner, the quantization audit, their subcommands."""

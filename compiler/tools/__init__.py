"""Tools over compiled tables: padding summaries, diffs, workload traces, capture-size
optimisation, the HTML report, the graph-memory model and the engine comparison. Each is a
``plan`` subcommand (``compiler/cli``); none is needed to compile a plan or load a table."""

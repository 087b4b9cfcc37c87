"""Pictures: the dependency graph and timelines (predicted by the cost model, or measured)."""

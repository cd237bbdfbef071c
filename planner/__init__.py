"""Plan search (imported as ``hetero.planner``)."""

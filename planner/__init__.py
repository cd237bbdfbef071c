"""Plan search (imported as ``hetero.planner``): find the hybrid-parallel plan with the highest
predicted throughput for a heterogeneous cluster. See :mod:`hetero.planner.search`."""
from .search import Options, PlannerError, SearchResult, SearchResults, describe, search

__all__ = ["search", "SearchResult", "SearchResults", "PlannerError", "Options", "describe"]

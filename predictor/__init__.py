"""Performance predictor (imported as ``hetero.predictor``)."""

"""Vendor backends (imported as ``hetero.backends``)."""

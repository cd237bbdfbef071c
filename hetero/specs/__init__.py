"""Specs: cluster, model and plan files, quantities with units, the device catalog."""

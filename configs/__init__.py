"""Shipped configuration: the device catalog (devices.yaml), example clusters and models."""

"""Learned per-operator latency model (pure Python + numpy; scikit-learn only for fitting).

    from hetero.predictor.opmodel import default_model
    seconds = default_model().predict("linear", {"B": 1, "M": 4096, "N": 4096, "K": 4096}, "fp32", device)
"""
from .features import OPS, roofline_latency
from .model import OpModel, default_model
from .specs import Records, device_from_neusight, load_neusight, load_neusight_devices, shared_data_dir

__all__ = ["OPS", "OpModel", "Records", "default_model", "device_from_neusight", "load_neusight",
           "load_neusight_devices", "roofline_latency", "shared_data_dir"]

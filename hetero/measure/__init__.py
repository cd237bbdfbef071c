"""Measuring on this machine: what ``hetero profile`` times with torch.

The predictor (:mod:`hetero.predictor`) reads measurements and never imports torch; the code that
takes them lives here, beside the runtime whose model and optimizer it times
(:mod:`hetero.measure.profiling`: operator latencies over a grid of shapes, and on a CPU the
runtime's own transformer block and AdamW step).
"""

"""Live resharding of training state between two plans, rank to rank (no disk, no restart).

- :mod:`.space`: the virtual parameter space (tensor name + box) and each rank's regions in a plan;
- :mod:`.transition`: the intersections between old and new owners, sources chosen among replicas;
- :mod:`.transfer`: the point-to-point exchange under a memory bound and the rebuilt stage;
- :mod:`.predict`: a transition's downtime from the bytes each link carries.
"""

"""A deep stage's request sequence from a recording of a shallower one: its layers repeated.

Every transformer layer of a stage runs the same operators on the same shapes, so a stage of ``L``
layers requests what a stage of four requests with the third layer's requests repeated ``L - 3``
times, each repetition in the place the runtime makes it: its forward's between the layer before's
and the layer after's, its backward's likewise in reverse, its parameters, gradients, moments and
its share of the gradient buffers where the optimizer and the gradient sum make them.

The recording (:func:`hetero.memplan.record.record_stage` with ``marks=True``) carries marks beside
its ``("alloc" | "free", id, size)`` events:

- ``("seg", layer, +1 | -1)``: the requests between belong to ``layer`` (a block's forward, from
  its input to its output; its backward, from its output's gradient to its input's; a ZeRO shard's
  gradient); marks nest, the innermost open layer owns a request;
- ``("own", id, layer)``: the block ``id`` names now (a parameter, an AdamW moment) is ``layer``'s;
- ``("agg", bytes)`` .. ``("agg", None)``: an allocation over every layer's gradients in between
  (the gradient buffer, the sum's flat buffer) grows by ``bytes`` per added layer.

Requests outside any segment that touch a layer's blocks (its moments' allocation, its gradients'
frees by ``zero_grad``) are that layer's too. A repeated layer's requests keep their order; a
block one repetition takes from its neighbour (the layer's input is the output of the layer before,
the gradient of its output comes from the layer after) is that neighbour repetition's block of the
same rank among its layer's allocations. :func:`expand_layers` checks that the layers it relies on
allocate alike and refuses (``ValueError``) where they do not.
"""
from __future__ import annotations

from hetero.memplan.trace import AllocationTrace


def expand_layers(events, chunks, depth: dict[int, int]) -> AllocationTrace:
    """The trace of the stage whose chunk starting at layer ``a`` (``chunks``: the recorded
    ``(a, b)`` ranges) holds ``depth[a]`` layers rather than ``b - a``. A chunk to deepen must have
    been recorded with 4 layers at least: its third is repeated, its second and fourth are the
    neighbours a repetition takes blocks from."""
    # which chunk's middle layer repeats, and how often
    repeat: dict[int, tuple[int, int]] = {}   # middle layer -> (copies, layer before it)
    for a, b in chunks:
        extra = depth.get(a, b - a) - (b - a)
        if extra < 0:
            raise ValueError(f"chunk {a}-{b} is recorded deeper than {depth[a]} layers")
        if extra:
            if b - a < 4:
                raise ValueError(f"chunk {a}-{b}: record 4 layers at least to deepen it")
            repeat[a + 2] = (extra + 1, a + 1)
    # pass 1: block instances, their owner layer and rank among the owner's allocations
    inst_of: dict[int, int] = {}   # recorded id -> current instance
    size, owner, grow = [], [], []
    stack: list[int] = []
    agg = 0
    plain = []   # (kind, instance, segment owner at the event)
    for e in events:
        kind = e[0]
        if kind == "seg":
            if e[2] > 0:
                stack.append(e[1])
            elif e[1] in stack:
                del stack[len(stack) - 1 - stack[::-1].index(e[1])]
        elif kind == "own":
            if e[1] in inst_of:
                owner[inst_of[e[1]]] = e[2]
        elif kind == "agg":
            agg = e[1] or 0
        elif kind == "alloc":
            inst_of[e[1]] = len(size)
            size.append(e[2])
            owner.append(stack[-1] if stack else None)
            grow.append(agg)
            plain.append(("alloc", inst_of[e[1]], stack[-1] if stack else None))
        elif e[1] in inst_of:
            plain.append(("free", inst_of.pop(e[1]), stack[-1] if stack else None))
    ranks: dict[int, list[int]] = {}
    rank = [0] * len(size)
    for i, o in enumerate(owner):
        if o is not None:
            rank[i] = len(ranks.setdefault(o, []))
            ranks[o].append(i)
    for mid, (_copies, before) in repeat.items():
        sizes = [[size[i] for i in ranks.get(layer, [])] for layer in (before, mid, mid + 1)]
        if not sizes[1] or sizes[0] != sizes[1] or sizes[1] != sizes[2]:
            raise ValueError(f"layers {before}-{mid + 1} do not allocate alike: cannot repeat layer {mid}")
    extra_layers = sum(c - 1 for c, _ in repeat.values())

    def run_of(_kind, inst, seg):
        return seg if seg is not None else owner[inst]

    # pass 2: emit, repeating each run of a middle layer's events
    out: list[tuple[str, int, int]] = []
    new_id: dict[tuple[int, int], int] = {}

    def ident(inst: int, copy: int) -> int:
        key = (inst, copy)
        if key not in new_id:
            new_id[key] = len(new_id)
        return new_id[key]

    def emit(kind, inst, at_layer, copy):
        # which repetition of which block this event of a run of ``at_layer`` (repetition ``copy``) means
        o = owner[inst]
        c = 0
        if o in repeat:
            n = repeat[o][0]
            c = copy if at_layer == o else (n - 1 if at_layer == o + 1 else 0)
        elif at_layer in repeat:
            n, before = repeat[at_layer]
            if o == before and copy > 0:
                inst, c = ranks[at_layer][rank[inst]], copy - 1
            elif o == at_layer + 1 and copy < n - 1:
                inst, c = ranks[at_layer][rank[inst]], copy + 1
        nbytes = size[inst] + grow[inst] * extra_layers
        out.append((kind, ident(inst, c), nbytes))

    i, previous = 0, None
    while i < len(plain):
        layer = run_of(*plain[i])
        j = i + 1
        while j < len(plain) and run_of(*plain[j]) == layer:
            j += 1
        copies = range(repeat[layer][0] if layer in repeat else 1)
        if layer is not None and previous == layer + 1:   # a backward: the later repetitions first
            copies = reversed(copies)
        for copy in copies:
            for kind, inst, _seg in plain[i:j]:
                emit(kind, inst, layer, copy)
        previous = layer if layer is not None else previous
        i = j
    return AllocationTrace(out, source=f"expanded to {depth} layers per chunk")

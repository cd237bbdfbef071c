"""The engines' common interface (hetero.runtime.engine_api), the one owner of process groups
(hetero.runtime.parallel) and the step's timing spans, checked without starting processes."""
from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

import hetero
from hetero.layout import build_layout
from helpers import CLUSTER, GPT
from helpers import plan_dict as _plan


def _missing(cls, protocol) -> list[str]:
    """What ``cls`` lacks of ``protocol``: methods (by name and parameter names) and data attributes
    (set on the class or assigned to ``self.<name>`` in its code)."""
    assigned = set(vars(cls))
    for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            assigned.add(node.attr)
    missing = [name for name in protocol.__annotations__ if name not in assigned]
    for name, fn in vars(protocol).items():
        if inspect.isfunction(fn) and not name.startswith("_"):
            mine = getattr(cls, name, None)
            if mine is None or list(inspect.signature(mine).parameters) != list(inspect.signature(fn).parameters):
                missing.append(name)
    return missing


def test_both_engines_implement_the_engine_protocol():
    from hetero.runtime.ds_engine import DeepSpeedEngine
    from hetero.runtime.engine import NativeEngine
    from hetero.runtime.engine_api import Engine

    assert {"train_step", "save", "load", "step_loss_scale"} <= set(dir(Engine)) | set(Engine.__annotations__)
    assert _missing(NativeEngine, Engine) == []
    assert _missing(DeepSpeedEngine, Engine) == []

    class NoLoad:   # the check can fail: a class without load, with another train_step
        name, step_loss_scale, step_skipped = "x", None, False

        def train_step(self, step):
            return 0.0, 0.0

        def set_lr(self, lr):
            pass

        def save(self, path, step):
            pass

        def optimizer_state_bytes(self):
            return None

    assert _missing(NoLoad, Engine) == ["train_step", "load"]
    assert not isinstance(NoLoad(), Engine)


def test_the_parallel_layout_holds_every_group_of_the_run():
    from hetero.runtime.grads import all_holder_sets, param_holders
    from hetero.runtime.parallel import ParallelLayout

    plan = hetero.load_plan(_plan([{"micro_batches": 2, "stages": [{"group": "fast", "tp": 2, "layers": [0, 2]},
                                                                   {"group": "slow", "layers": [2, 4]}]},
                                   {"micro_batches": 2, "stages": [{"group": "slow", "layers": [0, 4]}]}]))
    model = hetero.load_model(GPT)
    layout = build_layout(hetero.load_cluster(CLUSTER), plan)
    tp = [layout.stage_ranks(0, 0, 0)]
    par = ParallelLayout.build(model, plan, layout, tp[0][1])
    assert par.holders == param_holders(model, plan, layout)
    assert par.tp_sets == par.mesh_sets == (tuple(tp[0]),) and par.tp_ranks() == tp[0]
    assert set(par.group_sets) >= {tuple(tp[0]), *all_holder_sets(par.holders)}
    ds = ParallelLayout.build(model, plan, layout, 0, engine="deepspeed")
    assert ds.holders == {} and ds.group_sets == ds.mesh_sets == ()

    class Comm:   # create_groups hands every set over once, tp meshes apart
        def create_groups(self, rank_sets, mesh_sets=()):
            self.sets, self.meshes = list(rank_sets), list(mesh_sets)

    comm = Comm()
    par.create_groups(comm)
    assert comm.sets == list(par.group_sets) and comm.meshes == [tuple(tp[0])]
    assert ParallelLayout.build(model, plan, layout, layout.stage_ranks(0, 0, 1)[0]).tp_mesh(comm, "cpu") is None


def test_a_timing_span_adds_its_seconds_and_records_its_event():
    import time

    from hetero.runtime.pipeline import Timings

    t = Timings()
    t.sync_s = -0.5   # a part counted elsewhere, taken out first
    with t.span("sync_s", event="S"):
        time.sleep(0.01)
    with t.span("sync_s"):
        pass
    assert 0.01 - 0.5 <= t.sync_s < 0.5 and len(t.events) == 1
    kind, mb, start, seconds = t.events[0]
    assert (kind, mb) == ("S", -1) and seconds >= 0.01 and start == pytest.approx(time.time(), abs=5)

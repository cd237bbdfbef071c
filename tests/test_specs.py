"""Cluster, model and plan specs: loading, defaults, round-trips and every validation rule."""
import copy

import pytest
import yaml

import hetero
from hetero.specs.errors import SpecError

CLUSTER = {
    "name": "lab",
    "devices": {"cpu-slow": {"base": "cpu", "vendor": "emu-b", "slowdown": 2.0}},
    "groups": [
        {"name": "a100", "device": "A100-SXM4-80GB", "nodes": 2, "devices_per_node": 8,
         "intra_node": {"bandwidth": "300 GB/s", "latency": "5 us"}},
        {"name": "mi250", "device": "MI250X", "nodes": 1, "devices_per_node": 4,
         "intra_node": {"bandwidth": "100 GB/s"}},
        {"name": "slow", "device": "cpu-slow", "nodes": 1, "devices_per_node": 2},
    ],
    "network": {"inter_node": {"bandwidth": "200 Gb/s", "latency": "10 us"},
                "cross_group": {"bandwidth": "25 GB/s", "latency": "20 us"}},
}
MODEL = {"name": "m", "architecture": "gpt", "num_layers": 24, "hidden_size": 1024,
         "num_attention_heads": 16, "vocab_size": 50257, "seq_length": 1024}
PLAN = {
    "global_batch_size": 64, "micro_batch_size": 2, "schedule": "1f1b",
    "pipelines": [
        {"replicas": 2, "micro_batches": 8,
         "stages": [{"group": "a100", "tp": 4, "layers": [0, 14]}, {"group": "mi250", "tp": 2, "layers": [14, 24]}]},
        {"replicas": 1, "micro_batches": 16,
         "stages": [{"group": "a100", "tp": 8, "layers": [0, 24]}]},
    ],
}


def problems_of(exc: SpecError) -> list[str]:
    return [str(p) for p in exc.problems]


def expect_error(fn, *fragments):
    with pytest.raises(SpecError) as info:
        fn()
    text = "\n".join(problems_of(info.value))
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} not in:\n{text}"
    return info.value


# --- cluster --------------------------------------------------------------------------------------

def test_cluster_loads_with_units_and_inheritance():
    c = hetero.load_cluster(CLUSTER)
    assert c.num_devices == 16 + 4 + 2
    assert c.group("a100").intra_node.bandwidth == 300e9
    assert c.group("a100").intra_node.latency == pytest.approx(5e-6)
    assert c.network.inter_node.bandwidth == 25e9          # 200 Gb/s in bytes/s
    slow = c.device_type("slow")
    cpu = hetero.load_catalog()["cpu"]
    assert slow.vendor == "emu-b" and slow.slowdown == 2.0 and slow.family == "cpu" and slow.is_emulated
    assert slow.memory == cpu.memory                        # inherited from base
    assert slow.matrix_flops("fp32") == pytest.approx(cpu.matrix_flops("fp32") / 2)
    assert c.vendor("a100") == "nvidia" and c.vendor("mi250") == "amd"


def test_cluster_round_trip(tmp_path):
    c = hetero.load_cluster(CLUSTER)
    path = tmp_path / "c.yaml"
    c.save(path)
    again = hetero.load_cluster(path)
    assert again.groups == c.groups and again.network == c.network
    assert again.device_types == c.device_types


@pytest.mark.parametrize("mutate,fragments", [
    (lambda d: d["groups"][1].update(devices_per_nodes=8), ["groups[1].devices_per_nodes", "did you mean 'devices_per_node'"]),
    (lambda d: d["groups"][1].update(devices_per_node="eight"), ["groups[1].devices_per_node", "expected an integer"]),
    (lambda d: d["groups"][1].update(devices_per_node=0), ["groups[1].devices_per_node", "must be >= 1"]),
    (lambda d: d["groups"][0].update(device="A100-SXM4-80G"), ["groups[0].device", "did you mean 'A100-SXM4-80GB'"]),
    (lambda d: d["groups"][0]["intra_node"].update(bandwidth="300 GB"), ["groups[0].intra_node.bandwidth", "unit of bytes"]),
    (lambda d: d["network"]["cross_group"].update(bandwidth="25 parsecs"), ["network.cross_group.bandwidth", "unknown unit"]),
    (lambda d: d["groups"][2].update(name="a100"), ["groups[2].name", "duplicate group name"]),
    (lambda d: d["groups"][0].update(hosts=["n0"]), ["groups[0].hosts", "one host per node"]),
    (lambda d: d["groups"][0].pop("nodes"), ["groups[0].nodes", "required field is missing"]),
    (lambda d: d.update(netwrok={}), ["netwrok", "did you mean 'network'"]),
    (lambda d: d["devices"]["cpu-slow"].update(base="cpux"), ["devices.cpu-slow.base", "unknown device type 'cpux'"]),
    (lambda d: d["devices"]["cpu-slow"].update(slowdown=0.5), ["devices.cpu-slow.slowdown", "must be >= 1"]),
    (lambda d: d["devices"]["cpu-slow"].update(slowdown=1e308), ["devices.cpu-slow.slowdown", "must be at most 1000"]),
    (lambda d: d["devices"].update(npu={"vendor": "huawey", "memory": "64 GiB", "memory_bandwidth": "1 TB/s",
                                        "peak_flops": {"fp16": "300 TFLOPS"}}), ["devices.npu.vendor", "unknown vendor"]),
    (lambda d: d["devices"].update(npu={"vendor": "ascend", "memory": "64 GiB", "memory_bandwidth": "1 TB/s",
                                        "peak_flops": {"fp16x": "300 TFLOPS"}}), ["devices.npu.peak_flops.fp16x", "did you mean 'fp16'"]),
])
def test_cluster_errors(mutate, fragments):
    data = copy.deepcopy(CLUSTER)
    mutate(data)
    expect_error(lambda: hetero.load_cluster(data), *fragments)


def test_device_base_problems_are_reported_once_with_the_whole_cycle():
    data = copy.deepcopy(CLUSTER)
    data["devices"] = {"x": {"base": "y"}, "y": {"base": "x"}, "u": {"base": "nope"}, "v": {"base": "u"}}
    data["groups"][2]["device"] = "v"
    err = expect_error(lambda: hetero.load_cluster(data), "inheritance cycle x -> y -> x", "unknown device type 'nope'")
    messages = [p.message for p in err.problems]
    assert sum("cycle" in m for m in messages) == 1
    assert sum("'nope'" in m for m in messages) == 1


def test_cluster_reports_all_errors_at_once():
    data = copy.deepcopy(CLUSTER)
    data["groups"][0]["nodes"] = "two"
    data["groups"][1]["devices_per_nodes"] = 8
    data["network"]["inter_node"]["bandwidth"] = "fast"
    err = expect_error(lambda: hetero.load_cluster(data), "groups[0].nodes", "groups[1].devices_per_nodes",
                       "network.inter_node.bandwidth")
    assert len(err.problems) >= 3


def test_errors_name_the_file(tmp_path):
    data = copy.deepcopy(CLUSTER)
    data["groups"][1]["devices_per_node"] = -1
    path = tmp_path / "bad-cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    expect_error(lambda: hetero.load_cluster(path), str(path), "groups[1].devices_per_node")


def test_unsafe_yaml_is_rejected(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("name: !!python/object/apply:os.system ['echo pwned']\ngroups: []\n")
    expect_error(lambda: hetero.load_cluster(path), "not valid YAML")


# --- model ----------------------------------------------------------------------------------------

def test_model_defaults_gpt_and_llama():
    gpt = hetero.load_model(MODEL)
    assert gpt.ffn_hidden_size == 4096 and gpt.activation == "gelu" and gpt.tie_embeddings is True
    assert gpt.num_kv_heads == 16
    llama = hetero.load_model({"name": "l7", "architecture": "llama", "num_layers": 32, "hidden_size": 4096,
                               "num_attention_heads": 32, "vocab_size": 32000, "seq_length": 4096, "dtype": "bf16"})
    assert llama.ffn_hidden_size == 11008 and llama.activation == "swiglu" and llama.tie_embeddings is False
    # Llama 2 7B has 6.74 B parameters.
    assert llama.total_params() == pytest.approx(6.738e9, rel=2e-3)


def test_model_spec_built_directly_gets_the_same_defaults():
    """Defaults are filled at construction, not only by load_model: no caller needs a fallback."""
    from hetero.specs.model import ModelSpec

    direct = ModelSpec(name="l7", architecture="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                       vocab_size=32000, seq_length=4096, dtype="bf16")
    assert (direct.ffn_hidden_size, direct.activation, direct.num_kv_heads, direct.tie_embeddings) == \
        (11008, "swiglu", 32, False)
    assert direct == hetero.load_model({"name": "l7", "architecture": "llama", "num_layers": 32, "hidden_size": 4096,
                                        "num_attention_heads": 32, "vocab_size": 32000, "seq_length": 4096,
                                        "dtype": "bf16"})
    assert direct.total_params() == pytest.approx(6.738e9, rel=2e-3)


def test_gpt2_parameter_count():
    # GPT-2 large (774 M with tied embeddings).
    m = hetero.load_model({"name": "gpt2-large", "architecture": "gpt", "num_layers": 36, "hidden_size": 1280,
                           "num_attention_heads": 20, "vocab_size": 50257, "seq_length": 1024})
    assert m.total_params() == pytest.approx(774.0e6, rel=2e-3)


def test_model_round_trip(tmp_path):
    m = hetero.load_model(MODEL)
    m.save(tmp_path / "m.yaml")
    assert hetero.load_model(tmp_path / "m.yaml") == m


@pytest.mark.parametrize("mutate,fragments", [
    (lambda d: d.update(hidden_size=1000), ["hidden_size", "not divisible by num_attention_heads"]),
    (lambda d: d.update(num_kv_heads=5), ["num_kv_heads", "must divide"]),
    (lambda d: d.update(architecture="bert"), ["architecture", "'gpt', 'llama'"]),
    (lambda d: d.update(dtype="fp8"), ["dtype"]),
    (lambda d: d.update(activation="swiglu"), ["activation", "llama"]),
    (lambda d: d.update(num_layer=3), ["num_layer", "did you mean 'num_layers'"]),
    (lambda d: d.update(num_layers=0), ["num_layers", "must be >= 1"]),
    (lambda d: d.pop("vocab_size"), ["vocab_size", "required field is missing"]),
])
def test_model_errors(mutate, fragments):
    data = copy.deepcopy(MODEL)
    mutate(data)
    expect_error(lambda: hetero.load_model(data), *fragments)


# --- plan -----------------------------------------------------------------------------------------

def load_all(plan_dict):
    return hetero.load_plan(plan_dict, hetero.load_cluster(CLUSTER), hetero.load_model(MODEL))


def test_plan_loads_and_round_trips(tmp_path):
    plan = load_all(PLAN)
    assert plan.devices_by_group() == {"a100": 2 * 4 + 8, "mi250": 2 * 2}
    plan.save(tmp_path / "p.yaml")
    assert hetero.load_plan(tmp_path / "p.yaml") == plan
    assert "a100[tp4,L0-13]" in plan.one_line()


@pytest.mark.parametrize("mutate,fragments", [
    # gap between stages
    (lambda d: d["pipelines"][0]["stages"][1].update(layers=[15, 24]),
     ["pipelines[0].stages[1].layers", "layers 14..14 are in no stage"]),
    # overlap
    (lambda d: d["pipelines"][0]["stages"][1].update(layers=[12, 24]),
     ["pipelines[0].stages[1].layers", "overlap"]),
    # short of the model
    (lambda d: d["pipelines"][1]["stages"][0].update(layers=[0, 20]),
     ["pipelines[1].stages[0].layers", "layers 20..23 are in no stage"]),
    # beyond the model
    (lambda d: d["pipelines"][1]["stages"][0].update(layers=[0, 30]),
     ["pipelines[1].stages[0].layers", "only 24 layers"]),
    # tp not dividing heads
    (lambda d: d["pipelines"][0]["stages"][1].update(tp=3), ["pipelines[0].stages[1].tp", "does not divide num_attention_heads=16"]),
    # tp larger than a node
    (lambda d: d["pipelines"][0]["stages"][1].update(tp=8), ["pipelines[0].stages[1].tp", "exceeds the 4 devices of one node"]),
    # too many devices in a group
    (lambda d: d["pipelines"][1].update(replicas=2, micro_batches=4),
     ["group 'a100' has 16 devices", "uses 24"]),
    # batch arithmetic
    (lambda d: d["pipelines"][1].update(micro_batches=15), ["global_batch_size", "= 62", "not global_batch_size=64"]),
    # unknown group, with a suggestion
    (lambda d: d["pipelines"][0]["stages"][1].update(group="mi25"), ["pipelines[0].stages[1].group", "did you mean 'mi250'"]),
    # enumerations
    (lambda d: d.update(schedule="1f1f"), ["schedule", "did you mean '1f1b'"]),
    (lambda d: d.update(zero_stage=3), ["zero_stage"]),
    # integers are integers: not strings, not booleans (true is 1 in Python), not fractions
    (lambda d: d.update(zero_stage="1"), ["zero_stage", "expected an integer, got '1'", "write 1 without quotes"]),
    (lambda d: d.update(zero_stage=True), ["zero_stage", "expected an integer, got True"]),
    (lambda d: d.update(micro_batch_size="2"), ["micro_batch_size", "write 2 without quotes"]),
    (lambda d: d["pipelines"][0].update(replicas=True), ["pipelines[0].replicas", "expected an integer"]),
    (lambda d: d["pipelines"][0].update(micro_batches=8.5), ["pipelines[0].micro_batches", "expected an integer"]),
    (lambda d: d["pipelines"][0]["stages"][0].update(tp="4"), ["pipelines[0].stages[0].tp", "without quotes"]),
    (lambda d: d.update(recompute="partial"), ["recompute"]),
    (lambda d: d["pipelines"][0].update(replica=2), ["pipelines[0].replica", "did you mean 'replicas'"]),
])
def test_plan_errors(mutate, fragments):
    data = copy.deepcopy(PLAN)
    mutate(data)
    expect_error(lambda: load_all(data), *fragments)


@pytest.mark.parametrize("layers,fragment", [
    ([[-1, 14], [14, 24]], "pipelines[0].stages[0].layers: [-1, 14]: the start must be >= 0"),
    ([[0, 30], [14, 24]], "pipelines[0].stages[0].layers: [0, 30] runs to layer 30 but the model has only 24"),
    ([[0, 14], [14, 14]], "pipelines[0].stages[1].layers: [14, 14] is empty or reversed"),
])
def test_plan_stage_ranges_are_judged_on_their_own(layers, fragment):
    data = copy.deepcopy(PLAN)
    for stage, span in zip(data["pipelines"][0]["stages"], layers):
        stage["layers"] = span
    error = expect_error(lambda: load_all(data), fragment)
    assert len(error.problems) == 1, problems_of(error)   # not also an overlap or a gap
    if layers[0][0] < 0:   # a start below 0 needs no model: the plan alone is refused
        expect_error(lambda: hetero.load_plan(data), "the start must be >= 0")


@pytest.mark.parametrize("kind,mutate,path", [
    ("plan", lambda d: d.update(micro_batch_size=2.0), "micro_batch_size"),
    ("plan", lambda d: d.update(zero_stage=1.0), "zero_stage"),
    ("plan", lambda d: d["pipelines"][0].update(replicas=2.0), "pipelines[0].replicas"),
    ("plan", lambda d: d["pipelines"][1].update(micro_batches=16.0), "pipelines[1].micro_batches"),
    ("plan", lambda d: d["pipelines"][0]["stages"][1].update(tp=2.0), "pipelines[0].stages[1].tp"),
    ("plan", lambda d: d["pipelines"][0]["stages"][0].update(layers=[0, 14.0]), "pipelines[0].stages[0].layers[1]"),
    ("cluster", lambda d: d["groups"][1].update(devices_per_node=4.0), "groups[1].devices_per_node"),
    ("cluster", lambda d: d["groups"][0].update(nodes=2.0), "groups[0].nodes"),
    ("cluster", lambda d: d["devices"]["cpu-slow"].update(compute_units=4.0), "devices.cpu-slow.compute_units"),
    ("model", lambda d: d.update(num_layers=24.0), "num_layers"),
    ("model", lambda d: d.update(num_kv_heads=16.0), "num_kv_heads"),
])
def test_integer_fields_refuse_a_whole_float(tmp_path, kind, mutate, path):
    """Integers in our files are written as integers: ``2.0`` is an error naming the file, the field
    and the fix (it used to be read as 2), in every file the shared reader loads."""
    data = copy.deepcopy({"plan": PLAN, "cluster": CLUSTER, "model": MODEL}[kind])
    mutate(data)
    file = tmp_path / f"{kind}.yaml"
    file.write_text(yaml.safe_dump(data))
    load = {"plan": hetero.load_plan, "cluster": hetero.load_cluster, "model": hetero.load_model}[kind]
    err = expect_error(lambda: load(file), f"{file}: {path}: expected an integer, got ", " (a float) (fix: write ",
                       " without the decimal point)")
    assert len(err.problems) == 1, problems_of(err)
    expect_error(lambda: load(data), f"{path}: expected an integer")   # a dict from Python: the same rule


def test_plan_tp_blocks_must_pack_into_nodes():
    cluster = copy.deepcopy(CLUSTER)
    cluster["groups"][0].update(nodes=2, devices_per_node=6)   # 12 devices, tp4 blocks: 1 per node +2 left
    plan = copy.deepcopy(PLAN)
    plan["pipelines"] = [{"replicas": 3, "micro_batches": 8, "stages": [{"group": "a100", "tp": 4, "layers": [0, 24]}]}]
    plan["global_batch_size"] = 48
    with pytest.raises(SpecError, match="do not fit"):
        hetero.load_plan(plan, hetero.load_cluster(cluster), hetero.load_model(MODEL))


def test_plan_interleaved_rules():
    plan = copy.deepcopy(PLAN)
    plan["schedule"] = "interleaved"
    plan["pipelines"] = [{"replicas": 1, "micro_batches": 32, "stages": [
        {"group": "a100", "tp": 8, "layers": [0, 6]}, {"group": "mi250", "tp": 4, "layers": [6, 12]},
        {"group": "a100", "tp": 8, "layers": [12, 18]}, {"group": "mi250", "tp": 4, "layers": [18, 24]}]}]
    ok = load_all(plan)
    assert ok.devices_by_group() == {"a100": 8, "mi250": 4}
    plan["pipelines"][0]["stages"][3]["tp"] = 2
    expect_error(lambda: load_all(plan), "pipelines[0].stages[3]", "runs on the devices of stage 1")


def test_layout_is_contiguous_per_node_and_keeps_tp_inside_nodes():
    from hetero.layout import build_layout

    cluster, plan = hetero.load_cluster(CLUSTER), load_all(PLAN)
    layout = build_layout(cluster, plan)
    assert layout.world_size == 2 * (4 + 2) + 8
    for r in layout.ranks:
        tp_group = layout.stage_ranks(r.pipeline, r.replica, r.stage)
        assert len(tp_group) == r.tp_size
        assert {(layout.ranks[x].group, layout.ranks[x].node) for x in tp_group} == {(r.group, r.node)}
    for slot in layout.nodes:
        members = layout.ranks[slot.first_rank: slot.first_rank + slot.num_ranks]
        assert all((m.group, m.node) == (slot.group, slot.node) for m in members)
    assert layout.pipeline_ranks(0, 1) and len(layout.pipeline_ranks(0, 1)) == 2

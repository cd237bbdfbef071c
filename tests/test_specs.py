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
    assert "a100[tp4,L0:14]" in plan.one_line()


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


# --- review fixes: plan arithmetic alone, catalog overrides, emulation vendors, dtype peaks, YAML ----

def test_plan_batch_arithmetic_is_checked_without_a_cluster_or_model():
    """replicas x micro_batches x micro_batch_size needs nothing but the plan: a plan alone is refused."""
    data = copy.deepcopy(PLAN)
    data["global_batch_size"] = 66
    expect_error(lambda: hetero.load_plan(data), "global_batch_size", "2x8x2 + 1x16x2 = 64", "not global_batch_size=66",
                 "fix: change micro_batches or the global batch size")
    assert hetero.load_plan(PLAN).global_batch_size == 64


def test_interleave_needs_the_interleaved_schedule():
    data = copy.deepcopy(PLAN)
    data["interleave"] = 2
    expect_error(lambda: hetero.load_plan(data), "interleave: only the interleaved schedule uses it, and schedule is '1f1b'",
                 "set 'schedule: interleaved'", "or drop 'interleave'")
    data["interleave"] = 0   # a bad value too: named once, with the fix
    expect_error(lambda: hetero.load_plan(data), "interleave: must be >= 1, got 0 (fix: model chunks per device")


def test_a_cluster_entry_named_like_a_catalog_device_overrides_it():
    """docs/formats.md: a cluster's ``devices:`` adds to / overrides the catalog. The fields given replace
    the catalog's, the rest is kept (with or without ``base:`` naming itself)."""
    a100 = hetero.load_catalog()["A100-SXM4-80GB"]
    for entry in ({"memory": "40 GiB"}, {"base": "A100-SXM4-80GB", "memory": "40 GiB"}):
        data = copy.deepcopy(CLUSTER)
        data["devices"]["A100-SXM4-80GB"] = entry
        data["devices"]["mine"] = {"base": "A100-SXM4-80GB", "clock": "1 GHz"}   # inherits the override
        data["groups"][2]["device"] = "mine"
        c = hetero.load_cluster(data)
        dev = c.device_type("a100")
        assert dev.memory == 40 * 2**30 and dev.vendor == "nvidia"
        assert (dev.memory_bandwidth, dev.peak_flops, dev.compute_units) == \
            (a100.memory_bandwidth, a100.peak_flops, a100.compute_units)
        mine = c.device_type("slow")
        assert mine.memory == 40 * 2**30 and mine.clock == 1e9 and mine.peak_flops == a100.peak_flops
        assert hetero.load_cluster(c.to_dict()).device_types == c.device_types   # saved as written
    # a peak of one dtype merges into the catalog's table
    data = copy.deepcopy(CLUSTER)
    data["devices"]["A100-SXM4-80GB"] = {"peak_flops": {"bf16": "300 TFLOPS"}}
    dev = hetero.load_cluster(data).device_type("a100")
    assert dev.peak_flops["bf16"] == 300e12 and dev.peak_flops["fp32"] == a100.peak_flops["fp32"]
    # an override is still checked, and a real cycle is still one
    data["devices"]["A100-SXM4-80GB"] = {"memory": "-1 GiB"}
    expect_error(lambda: hetero.load_cluster(data), "devices.A100-SXM4-80GB.memory", "is negative")
    data["devices"] = {"A100-SXM4-80GB": {"base": "x"}, "x": {"base": "A100-SXM4-80GB"}}
    expect_error(lambda: hetero.load_cluster(data), "inheritance cycle")


def test_a_cpu_device_with_a_real_vendor_is_refused_at_validation():
    """``{base: cpu, vendor: nvidia}`` is neither an emulated device (those carry a tag of their
    own) nor a real nvidia one (launch would want CUDA): an error with both fixes."""
    for chain in ({"x": {"base": "cpu", "vendor": "nvidia"}},
                  {"e": {"base": "cpu", "vendor": "emu-a"}, "x": {"base": "e", "vendor": "amd"}}):
        data = copy.deepcopy(CLUSTER)
        data["devices"].update(chain)
        data["groups"][2]["device"] = "x"
        vendor = chain["x"]["vendor"]
        expect_error(lambda: hetero.load_cluster(data), f"devices.x.vendor: vendor '{vendor}'", "is ambiguous",
                     "'vendor: emu-a'", "drop the 'base: cpu' link")
    data = copy.deepcopy(CLUSTER)   # the emulation idiom and a plain CPU type stay valid
    data["devices"]["x"] = {"base": "cpu", "vendor": "cpu", "slowdown": 3.0}
    data["groups"][2]["device"] = "x"
    assert hetero.load_cluster(data).device_type("slow").is_emulated


BF16_ONLY = {"vendor": "ascend", "memory": "64 GiB", "memory_bandwidth": "1.6 TB/s", "peak_flops": {"bf16": "320 TFLOPS"},
             "peak_flops_vector": {"fp32": "40 TFLOPS"}}   # matrix units for bf16 only; elementwise fp32


def test_matrix_peaks_never_give_an_fp32_model_a_half_precision_figure():
    from hetero.specs.device import DeviceType

    npu = DeviceType(vendor="ascend", memory=1e9, memory_bandwidth=1e12, peak_flops={"bf16": 320e12})
    assert npu.matrix_flops("bf16") == 320e12 and npu.matrix_flops("fp16") == 320e12   # the other half's units
    assert npu.matrix_peak("fp32") is None
    with pytest.raises(SpecError, match="no matrix peak for an fp32 model: needs fp32 \\(or tf32\\), lists bf16"):
        npu.matrix_flops("fp32")
    tf = DeviceType(vendor="nvidia", memory=1e9, memory_bandwidth=1e12, peak_flops={"tf32": 156e12, "bf16": 312e12})
    assert tf.matrix_flops("fp32") == 156e12
    both = DeviceType(vendor="nvidia", memory=1e9, memory_bandwidth=1e12, peak_flops={"fp32": 19.5e12, "fp16": 312e12})
    assert both.matrix_flops("bf16") == 19.5e12   # as before: a missing half dtype falls back to fp32 first


def test_the_elementwise_peak_never_falls_back_to_a_matrix_units_figure():
    """Without a peak_flops_vector entry for the dtype, elementwise kernels run at the fp32 figure
    (peak_flops_vector's, else peak_flops' CUDA-core fp32), never at a tf32 or half-precision matrix
    peak; with no fp32 figure at all there is no elementwise peak, and saying so is an error."""
    import dataclasses

    from hetero.predictor.opmodel.features import device_params
    from hetero.specs.device import DeviceType

    a100 = hetero.load_catalog()["A100-SXM4-80GB"]
    bare = dataclasses.replace(a100, peak_flops_vector={})
    fp32 = a100.peak_flops["fp32"]   # 19.5 TFLOPS, beside bf16 312 and tf32 156 in the same table
    for dtype in ("fp32", "bf16", "fp16"):
        assert bare.vector_flops(dtype) == fp32, dtype
        assert device_params(bare, dtype)[1] == fp32, dtype   # what the operator model is given
    assert dataclasses.replace(bare, slowdown=2.0).vector_flops("bf16") == fp32 / 2
    listed = dataclasses.replace(bare, peak_flops_vector={"fp32": 20e12, "bf16": 39e12})
    assert listed.vector_flops("bf16") == 39e12 and listed.vector_flops("fp16") == 20e12
    npu = DeviceType(vendor="nvidia", memory=1e9, memory_bandwidth=1e12, peak_flops={"tf32": 156e12, "bf16": 312e12})
    assert npu.vector_peak("fp32") is None and npu.vector_peak("bf16") is None
    with pytest.raises(SpecError, match="peak_flops_vector: no elementwise \\(non-matrix\\) fp32 peak for a bf16 "
                                        "model: peak_flops_vector lists nothing, peak_flops no fp32 entry"):
        npu.vector_flops("bf16")
    half_only = dataclasses.replace(npu, peak_flops_vector={"bf16": 39e12})   # the fp32 loss still needs one
    assert half_only.vector_flops("bf16") == 39e12 and half_only.vector_problem("bf16") is not None
    for name, device in hetero.load_catalog().items():
        assert device.vector_problem("bf16") is None, name


def test_a_device_without_an_elementwise_peak_is_an_error_naming_the_device():
    cluster = copy.deepcopy(CLUSTER)
    cluster["devices"]["npu"] = {k: v for k, v in BF16_ONLY.items() if k != "peak_flops_vector"}
    cluster["groups"][1]["device"] = "npu"
    c = hetero.load_cluster(cluster)
    model = hetero.load_model({**MODEL, "dtype": "bf16"})
    expect_error(lambda: hetero.load_plan(PLAN, c, model), "devices.npu.peak_flops_vector: device type 'npu' "
                 "(group 'mi250'), model 'm': no elementwise (non-matrix) fp32 peak for a bf16 model",
                 "fix: add 'fp32: <peak> TFLOPS' to peak_flops_vector")


@pytest.mark.parametrize("dtype,ok", [("fp32", False), ("bf16", True), ("fp16", True)])
def test_a_model_dtype_without_a_usable_peak_is_an_error_naming_the_device(dtype, ok):
    cluster = copy.deepcopy(CLUSTER)
    cluster["devices"]["npu"] = BF16_ONLY
    cluster["groups"][1]["device"] = "npu"
    model = hetero.load_model({**MODEL, "dtype": dtype})
    c = hetero.load_cluster(cluster)
    if ok:
        plan = hetero.load_plan(PLAN, c, model)
        # the fp32 loss runs elementwise only: predicted with no fp32 matrix peak on the device
        assert hetero.predict(c, model, plan).iteration_time_s > 0
        return
    expect_error(lambda: hetero.load_plan(PLAN, c, model), "devices.npu.peak_flops: device type 'npu' (group 'mi250')",
                 "model 'm': no matrix peak for an fp32 model", "add 'fp32: <peak> TFLOPS' to peak_flops",
                 "or use a model with dtype bf16 or fp16")
    plan = copy.deepcopy(PLAN)   # a plan that keeps off that group is not refused for it
    plan["pipelines"] = [plan["pipelines"][1], {**plan["pipelines"][1], "replicas": 1}]
    plan["pipelines"][1]["stages"] = [{"group": "a100", "tp": 8, "layers": [0, 24]}]
    assert hetero.load_plan(plan, c, model)


def test_every_catalog_device_has_a_peak_for_the_shipped_models():
    from conftest import CONFIGS

    dtypes = {hetero.load_model(p).dtype for p in (CONFIGS / "models").glob("*.yaml")} | {"fp32", "bf16", "fp16"}
    for name, device in hetero.load_catalog().items():
        for dtype in dtypes:
            assert device.peak_problem(dtype) is None, (name, dtype)


def test_provenance_names_the_cluster_file_for_its_own_device_types(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))   # no local profile: numbers from specs
    data = copy.deepcopy(CLUSTER)
    data["devices"]["A100-SXM4-80GB"] = {"memory": "40 GiB"}
    data["devices"]["npu"] = {**BF16_ONLY, "peak_flops": {"fp32": "80 TFLOPS"}}
    data["groups"][1]["device"] = "npu"
    data["groups"].append({"name": "h100", "device": "H100-SXM5-80GB", "nodes": 1, "devices_per_node": 8})
    cluster, model = hetero.load_cluster(data), hetero.load_model(MODEL)
    prov = hetero.predict(cluster, model, hetero.load_plan(PLAN, cluster, model)).provenance
    assert prov["A100-SXM4-80GB"]["source"] == "cluster file" and prov["npu"]["source"] == "cluster file"


@pytest.mark.parametrize("text,line,key", [
    ("name: lab\ngroups:\n  - name: a\n    device: cpu\n    nodes: 1\n    devices_per_node: 2\n    nodes: 4\n", 7, "nodes"),
    ("name: lab\nname: lab2\ngroups: []\n", 2, "name"),
])
def test_duplicate_yaml_keys_are_refused_with_their_line(tmp_path, text, line, key):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    err = expect_error(lambda: hetero.load_cluster(path), f"{path}: line {line}, column ", f"duplicate key '{key}'",
                       f"keep one '{key}:' in this mapping")
    assert len(err.problems) == 1


def test_the_yaml_loader_stays_safe_and_allows_merge_overrides():
    import yaml as pyyaml

    from hetero.specs.io import UniqueKeyLoader, load_yaml

    assert issubclass(UniqueKeyLoader, pyyaml.SafeLoader)
    assert load_yaml("base: &b {nodes: 1, x: 2}\ng: {<<: *b, nodes: 3}\n")["g"] == {"nodes": 3, "x": 2}
    with pytest.raises(pyyaml.YAMLError):
        load_yaml("a: !!python/object/apply:os.system ['true']\n")


@pytest.mark.parametrize("kind,key,fragment", [
    ("model", "recompute", "'recompute' is a field of a plan file, not of a model file (fix: move it to the plan file)"),
    ("model", "groups", "'groups' is a field of a cluster file, not of a model file"),
    ("plan", "dtype", "'dtype' is a field of a model file, not of a plan file (fix: move it to the model file)"),
    ("cluster", "zero_stage", "'zero_stage' is a field of a plan file, not of a cluster file"),
])
def test_a_field_of_another_file_is_named_as_such(kind, key, fragment):
    data = copy.deepcopy({"plan": PLAN, "cluster": CLUSTER, "model": MODEL}[kind])
    data[key] = "full" if key != "groups" else []
    load = {"plan": hetero.load_plan, "cluster": hetero.load_cluster, "model": hetero.load_model}[kind]
    err = expect_error(lambda: load(data), fragment)
    assert "did you mean" not in str(err)


def test_a_misplaced_field_does_not_hide_the_files_other_errors():
    """A field of another kind of file is named together with the range errors and the rules across
    fields, not instead of them (one run shows everything to fix)."""
    model = {**MODEL, "network": {"inter_node": {"bandwidth": "100 GB/s"}}, "dropout": 1.5}
    err = expect_error(lambda: hetero.load_model(model), "network: 'network' is a field of a cluster file",
                       "dropout: must be in [0, 1), got 1.5")
    assert len(err.problems) == 2
    plan = {**PLAN, "dtype": "bf16", "micro_batch_size": 0}
    expect_error(lambda: hetero.load_plan(plan), "'dtype' is a field of a model file", "micro_batch_size: must be >= 1")
    plan = {**PLAN, "dtype": "bf16", "global_batch_size": 66}   # the batch arithmetic is judged too
    expect_error(lambda: hetero.load_plan(plan), "'dtype' is a field of a model file", "not global_batch_size=66")
    cluster = {**copy.deepcopy(CLUSTER), "recompute": "full"}
    cluster["groups"][0]["nodes"] = 0
    expect_error(lambda: hetero.load_cluster(cluster), "'recompute' is a field of a plan file",
                 "groups[0].nodes: must be >= 1")


def test_one_misplaced_field_does_not_change_the_kind_of_a_file():
    from hetero.specs.kinds import file_kind

    assert file_kind({**MODEL, "groups": []}) == "model"
    assert file_kind({**CLUSTER, "num_layers": 2}) == "cluster"
    assert file_kind({**PLAN, "groups": []}) == "plan"
    assert file_kind({"groups": [], "num_layers": 2}) == "cluster"   # a tie: the order of the markers


def test_file_field_lists_match_the_specs():
    import dataclasses

    from hetero.specs.cluster import _ClusterFile
    from hetero.specs.kinds import FIELDS
    from hetero.specs.model import ModelSpec
    from hetero.specs.plan import Plan

    for kind, cls in (("cluster", _ClusterFile), ("model", ModelSpec), ("plan", Plan)):
        assert set(FIELDS[kind]) == {f.name for f in dataclasses.fields(cls) if f.init}, kind


@pytest.mark.parametrize("mutate,fragment", [
    (lambda d: d.update(architecture="mamba"), "'mamba' is not one of 'gpt', 'llama' (fix: choose one of gpt, llama)"),
    (lambda d: d.update(architecture="lama"), "(fix: did you mean 'llama'?)"),
    (lambda d: d.update(num_layers=0), "num_layers: must be >= 1, got 0 (fix: give the number of transformer blocks"),
    (lambda d: d.update(ffn_hidden_size=0), "ffn_hidden_size: must be >= 1, got 0 (fix: give the MLP width"),
    (lambda d: d.update(norm_eps=-1), "norm_eps: must be in (0, 1), got -1 (fix: "),
    (lambda d: d.update(norm_eps=0), "norm_eps: must be in (0, 1), got 0 (fix: "),
    (lambda d: d.update(rope_theta=0), "rope_theta: must be positive, got 0 (fix: "),
    (lambda d: d.update(dropout=1.5), "dropout: must be in [0, 1), got 1.5 (fix: "),
])
def test_model_range_errors_carry_a_fix(mutate, fragment):
    data = copy.deepcopy(MODEL)
    mutate(data)
    expect_error(lambda: hetero.load_model(data), fragment)


@pytest.mark.parametrize("mutate,fragment", [
    (lambda d: d["pipelines"][0].update(replicas=0), "pipelines[0].replicas: must be >= 1, got 0 (fix: "),
    (lambda d: d["pipelines"][0].update(micro_batches=0), "pipelines[0].micro_batches: must be >= 1, got 0 (fix: "),
    (lambda d: d["pipelines"][0].update(micro_batch_size=0), "pipelines[0].micro_batch_size: must be >= 1, got 0 (fix: "),
    (lambda d: d["pipelines"][0]["stages"][0].update(tp=0), "pipelines[0].stages[0].tp: must be >= 1, got 0 (fix: "),
    (lambda d: d.update(micro_batch_size=0), "micro_batch_size: must be >= 1, got 0 (fix: "),
])
def test_plan_range_errors_carry_a_fix(mutate, fragment):
    data = copy.deepcopy(PLAN)
    mutate(data)
    expect_error(lambda: hetero.load_plan(data), fragment)


def test_suggestions_need_a_close_name():
    from hetero.specs.errors import did_you_mean

    assert did_you_mean("recompute", ["dropout", "name"]).startswith("known names")
    assert did_you_mean("num_layer", ["num_layers", "name"]) == "did you mean 'num_layers'?"

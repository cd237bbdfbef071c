"""The CLI on good and bad input: exit status, the field named, no traceback."""
import copy

import pytest
import yaml

from conftest import CONFIGS, run_cli
from test_specs import CLUSTER, MODEL, PLAN


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def assert_bad_input(proc, *fragments):
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    for fragment in fragments:
        assert fragment in proc.stderr, f"{fragment!r} not in stderr:\n{proc.stderr}"


def test_validate_shipped_examples():
    files = sorted(str(p) for p in (CONFIGS / "clusters").glob("*.yaml")) + \
            sorted(str(p) for p in (CONFIGS / "models").glob("*.yaml"))
    assert len(files) >= 12
    proc = run_cli("validate", *files)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("ok") == len(files)


def test_validate_plan_against_cluster_and_model(tmp_path):
    c, m, p = write(tmp_path, "c.yaml", CLUSTER), write(tmp_path, "m.yaml", MODEL), write(tmp_path, "p.yaml", PLAN)
    proc = run_cli("validate", c, m, p)
    assert proc.returncode == 0, proc.stderr
    assert "fits" in proc.stdout


@pytest.mark.parametrize("kind,mutate,fragments", [
    ("cluster", lambda d: d["groups"][1].update(devices_per_nodes=8),
     ["groups[1].devices_per_nodes", "did you mean 'devices_per_node'"]),
    ("cluster", lambda d: d["groups"][0].update(nodes="two"), ["groups[0].nodes", "expected an integer"]),
    ("cluster", lambda d: d["network"]["inter_node"].update(bandwidth="100 GB"), ["network.inter_node.bandwidth", "unit"]),
    ("model", lambda d: d.update(num_kv_heads=3), ["num_kv_heads", "must divide"]),
    ("plan", lambda d: d["pipelines"][0]["stages"][1].update(layers=[15, 24]), ["pipelines[0].stages[1].layers"]),
    ("plan", lambda d: d["pipelines"][0]["stages"][0].update(tp=32), ["pipelines[0].stages[0].tp", "exceeds the 8 devices of one node"]),
    ("plan", lambda d: d["pipelines"][1].update(micro_batches=3), ["global_batch_size"]),
    ("plan", lambda d: d["pipelines"][1].update(replicas=3), ["group 'a100' has 16 devices"]),
    ("plan", lambda d: d["pipelines"][0].update(replicas=2.0),
     ["pipelines[0].replicas: expected an integer, got 2.0 (a float)", "write 2 without the decimal point"]),
    ("cluster", lambda d: d["groups"][1].update(devices_per_node=4.0),
     ["groups[1].devices_per_node: expected an integer, got 4.0 (a float)", "write 4 without the decimal point"]),
])
def test_validate_bad_input(tmp_path, kind, mutate, fragments):
    data = {"cluster": copy.deepcopy(CLUSTER), "model": copy.deepcopy(MODEL), "plan": copy.deepcopy(PLAN)}
    mutate(data[kind])
    files = [write(tmp_path, f"{k}.yaml", v) for k, v in data.items()]
    proc = run_cli("validate", *files)
    bad = files[["cluster", "model", "plan"].index(kind)]
    assert_bad_input(proc, bad, *fragments)


def test_validate_reports_every_error_of_a_file(tmp_path):
    data = copy.deepcopy(CLUSTER)
    data["groups"][0]["nodes"] = -1
    data["groups"][1]["devices_per_node"] = "x"
    data["nework"] = {}
    proc = run_cli("validate", write(tmp_path, "c.yaml", data))
    assert_bad_input(proc, "groups[0].nodes", "groups[1].devices_per_node", "nework")


def test_validate_names_a_misplaced_field_and_the_files_other_errors_at_once(tmp_path):
    data = {**MODEL, "groups": [], "zero_stage": 1, "dropout": 1.5}   # a cluster and a plan field
    m = write(tmp_path, "m.yaml", data)
    proc = run_cli("validate", m)
    assert_bad_input(proc, f"{m}: groups: 'groups' is a field of a cluster file, not of a model file",
                     f"{m}: zero_stage: 'zero_stage' is a field of a plan file", f"{m}: dropout: must be in [0, 1)")
    assert len(proc.stderr.splitlines()) == 3, proc.stderr
    assert proc.stdout.splitlines() == [f"error {m} (model)"]


@pytest.mark.parametrize("text,fragment", [
    ("groups: [unclosed", "not valid YAML"),
    ("- just\n- a list\n", "expected a YAML mapping"),
    ("", "the input file is empty"),
    ("# nothing but a comment\n", "the input file is empty"),
    ("foo: 1\n", "cannot tell whether"),
])
def test_validate_unreadable_files(tmp_path, text, fragment):
    assert_bad_input(run_cli("validate", write(tmp_path, "x.yaml", text)), fragment)


def test_validate_missing_file(tmp_path):
    assert_bad_input(run_cli("validate", str(tmp_path / "nope.yaml")), "not found")


def test_usage_error_is_exit_2():
    proc = run_cli("validate")
    assert proc.returncode == 2


def test_devices_table_and_json():
    proc = run_cli("devices")
    assert proc.returncode == 0, proc.stderr
    for name in ("A100-SXM4-80GB", "MI250X", "Ascend-910B", "Gaudi2"):
        assert name in proc.stdout
    import json

    proc = run_cli("devices", "--json")
    data = json.loads(proc.stdout)
    assert data["H100-SXM5-80GB"]["memory"] == 80 * 2**30


def test_console_script_and_module_agree():
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    exe = shutil.which("hetero") or str(Path(sys.executable).parent / "hetero")
    if not Path(exe).exists():
        pytest.skip("console script not installed (package not pip-installed)")
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "hetero" in proc.stdout


def test_json_output_refuses_a_number_that_is_not_finite(capsys):
    """JSON has no Infinity / NaN: a result that overflowed is an error, and nothing is printed."""
    import pytest

    from hetero.cli._common import print_json
    from hetero.errors import HeteroError

    print_json({"iteration_time_s": 1.5})
    assert capsys.readouterr().out == '{\n  "iteration_time_s": 1.5\n}\n'
    for bad in (float("inf"), float("nan")):
        with pytest.raises(HeteroError, match="not finite"):
            print_json({"pipelines": [{"forward_time_s": bad}]})
        assert capsys.readouterr().out == ""


def verdicts(proc, path):
    """The stdout lines that judge ``path`` (one per file)."""
    return [line for line in proc.stdout.splitlines() if line.split()[1:2] == [path]]


def test_validate_checks_a_plans_batch_arithmetic_alone_and_gives_one_verdict(tmp_path):
    data = copy.deepcopy(PLAN)
    data["global_batch_size"] = 66
    p = write(tmp_path, "p.yaml", data)
    proc = run_cli("validate", p)   # no cluster or model needed for the arithmetic
    assert_bad_input(proc, p, "global_batch_size", "= 64, not global_batch_size=66")
    assert verdicts(proc, p) == [f"error {p} (plan)"], proc.stdout
    c, m = write(tmp_path, "c.yaml", CLUSTER), write(tmp_path, "m.yaml", MODEL)
    for args in ((p, c, m), (p, "--cluster", c, "--model", m)):
        proc = run_cli("validate", *args)
        assert_bad_input(proc, "= 64, not global_batch_size=66")
        assert proc.stderr.count("not global_batch_size=66") == 1, proc.stderr
        assert verdicts(proc, p) == [f"error {p} (plan) against lab / m"], proc.stdout
        assert verdicts(proc, c) == [f"ok    {c} (cluster)"] and verdicts(proc, m) == [f"ok    {m} (model)"]
    good = write(tmp_path, "good.yaml", PLAN)
    proc = run_cli("validate", good, "--cluster", c, "--model", m)
    assert proc.returncode == 0, proc.stderr
    assert verdicts(proc, good) == [f"ok    {good} (plan) fits lab / m"], proc.stdout


def test_validate_reports_a_plans_problems_together(tmp_path):
    data = copy.deepcopy(PLAN)
    data["pipelines"][1].update(replicas=2, micro_batches=4)   # too many a100 devices, and 48 samples
    data["global_batch_size"] = 50
    c, m, p = write(tmp_path, "c.yaml", CLUSTER), write(tmp_path, "m.yaml", MODEL), write(tmp_path, "p.yaml", data)
    assert_bad_input(run_cli("validate", c, m, p), "group 'a100' has 16 devices", "not global_batch_size=50")


def test_validate_refuses_duplicate_keys_and_cpu_devices_with_a_real_vendor(tmp_path):
    text = "name: x\ngroups:\n  - {name: a, device: cpu, nodes: 1, devices_per_node: 2}\nname: y\n"
    path = write(tmp_path, "dup.yaml", text)
    assert_bad_input(run_cli("validate", path), f"{path}: line 4, column 1: duplicate key 'name' (first given at line 1)")
    data = copy.deepcopy(CLUSTER)
    data["devices"]["cpu-slow"]["vendor"] = "nvidia"
    path = write(tmp_path, "c.yaml", data)
    assert_bad_input(run_cli("validate", path), f"{path}: devices.cpu-slow.vendor", "ambiguous", "emu-a")


def test_validate_names_a_device_without_a_peak_for_the_models_dtype(tmp_path):
    data = copy.deepcopy(CLUSTER)
    data["devices"]["npu"] = {"vendor": "ascend", "memory": "64 GiB", "memory_bandwidth": "1.6 TB/s",
                              "peak_flops": {"bf16": "320 TFLOPS"}}
    data["groups"][1]["device"] = "npu"
    c, m, p = write(tmp_path, "c.yaml", data), write(tmp_path, "m.yaml", MODEL), write(tmp_path, "p.yaml", PLAN)
    proc = run_cli("validate", c, m)
    assert_bad_input(proc, f"{c}: devices.npu.peak_flops: device type 'npu' (group 'mi250'), model 'm': no matrix "
                           f"peak for an fp32 model", "fix: add 'fp32: <peak> TFLOPS' to peak_flops")
    assert verdicts(proc, c) == [f"error {c} (cluster) against model m"]
    proc = run_cli("validate", c, m, p)   # the problem is told once, with the cluster, and the plan is not "ok"
    assert proc.returncode == 1 and proc.stderr.count("no matrix peak") == 1, proc.stderr
    assert verdicts(proc, p)[0].startswith(f"error {p} (plan)")
    assert_bad_input(run_cli("predict", "--cluster", c, "--model", m, "--plan", p), "devices.npu.peak_flops")
    assert_bad_input(run_cli("plan", "--cluster", c, "--model", m, "--global-batch-size", "64"), "devices.npu.peak_flops")
    m16 = write(tmp_path, "m16.yaml", {**MODEL, "dtype": "bf16"})
    proc = run_cli("validate", c, m16)   # a bf16 model has its matrix peak, but nothing elementwise is listed
    assert_bad_input(proc, f"{c}: devices.npu.peak_flops_vector: device type 'npu' (group 'mi250'), model 'm': no "
                           f"elementwise (non-matrix) fp32 peak for a bf16 model")
    assert_bad_input(run_cli("predict", "--cluster", c, "--model", m16, "--plan", p), "devices.npu.peak_flops_vector")
    data["devices"]["npu"]["peak_flops_vector"] = {"fp32": "40 TFLOPS"}
    assert run_cli("validate", write(tmp_path, "c.yaml", data), m16).returncode == 0


def test_validate_an_examples_index_gives_each_entry_a_verdict(tmp_path):
    """Names are files in clusters/, models/ and plans/ beside the index; each plan is checked against
    its cluster and model, and a problem of a file several entries name is told once."""
    import shutil

    for kind, name in (("clusters", "local-cpu"), ("models", "tiny"), ("plans", "local-cpu-tiny")):
        (tmp_path / kind).mkdir()
        shutil.copy(CONFIGS / kind / f"{name}.yaml", tmp_path / kind)
    plan = yaml.safe_load((CONFIGS / "plans" / "local-cpu-tiny.yaml").read_text())
    plan["pipelines"][0]["stages"][0]["tp"] = 64   # more than a node holds
    write(tmp_path / "plans", "wide.yaml", plan)
    cluster = yaml.safe_load((CONFIGS / "clusters" / "local-cpu.yaml").read_text())
    cluster["groups"][0]["nodes"] = 0
    write(tmp_path / "clusters", "broken.yaml", cluster)
    index = write(tmp_path, "examples.yaml", {"examples": [
        {"cluster": "local-cpu", "model": "tiny", "plan": "local-cpu-tiny"},
        {"cluster": "local-cpu", "model": "tiny", "plan": "local-cpu-tinny"},
        {"cluster": "local-cpu", "model": "tiny", "plan": "wide"},
        {"cluster": "broken", "model": "tiny", "plan": "local-cpu-tiny"},
        {"cluster": "broken", "model": "tiny", "plan": "wide"},
        {"cluster": "local-cpu", "model": "tiny"},
        {"cluster": "clusters/local-cpu.yaml", "model": "tiny", "plan": "wide"},
    ]})
    proc = run_cli("validate", index)
    assert_bad_input(proc, f"{index}: examples[1].plan: no plan named 'local-cpu-tinny'", "did you mean 'local-cpu-tiny'?",
                     "wide.yaml: pipelines[0].stages[0].tp: tp=64 exceeds", "broken.yaml: groups[0].nodes: must be >= 1",
                     f"{index}: examples[5].plan: required field is missing",
                     f"{index}: examples[6].cluster: 'clusters/local-cpu.yaml' is not a cluster name")
    assert proc.stderr.count("groups[0].nodes") == 1, proc.stderr
    assert verdicts(proc, index) == [
        f"error {index} (examples) 6 of 7 entries fail",
        f"ok    {index} examples[0] (example) plan local-cpu-tiny fits local-cpu / tiny",
        f"error {index} examples[1] (example) plan local-cpu-tinny against local-cpu / tiny",
        f"error {index} examples[2] (example) plan wide against local-cpu / tiny",
        f"error {index} examples[3] (example) plan local-cpu-tiny against broken / tiny",
        f"error {index} examples[4] (example) plan wide against broken / tiny",
        f"error {index} examples[5] (example)",
        f"error {index} examples[6] (example) plan wide against clusters/local-cpu.yaml / tiny"]
    proc = run_cli("predict", "--cluster", index, "--model", str(tmp_path / "models" / "tiny.yaml"),
                   "--plan", str(tmp_path / "plans" / "local-cpu-tiny.yaml"))
    assert_bad_input(proc, f"{index}: this looks like an examples index file (it has 'examples'), not a cluster file")


def test_a_source_checkout_runs_without_being_installed():
    """`python -m hetero` in a repository nobody installed: predictor/, planner/, configs/ sit beside
    hetero/ and are found there (here the install's finder is taken away to show it)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    code = ("import runpy, sys; "
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            f"sys.path.insert(0, {str(root)!r}); sys.argv = ['hetero'] + sys.argv[1:]; "
            "runpy.run_module('hetero', run_name='__main__', alter_sys=True)")
    proc = subprocess.run([sys.executable, "-c", code, "predict", "--cluster", str(CONFIGS / "clusters" / "mixed-vendor.yaml"),
                           "--model", str(CONFIGS / "models" / "llama2-7b.yaml"),
                           "--plan", str(CONFIGS / "plans" / "mixed-vendor-llama2-7b.yaml"), "--json"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["tokens_per_s"] > 0

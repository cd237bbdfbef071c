"""Every shipped example (configs/examples.yaml) validates and predicts to the JSON of docs/formats.md."""
import json

import pytest
import yaml

from conftest import CONFIGS, run_cli

EXAMPLES = yaml.safe_load((CONFIGS / "examples.yaml").read_text())["examples"]
TOP_KEYS = {"iteration_time_s", "tokens_per_s", "samples_per_s", "mfu", "fits_memory",
            "upper_bound_tokens_per_s", "pipelines"}
STAGE_KEYS = {"group", "tp", "layers", "forward_time_s", "backward_time_s", "peak_memory_bytes",
              "memory_capacity_bytes"}


def paths(example):
    return (str(CONFIGS / "clusters" / f"{example['cluster']}.yaml"),
            str(CONFIGS / "models" / f"{example['model']}.yaml"),
            str(CONFIGS / "plans" / f"{example['plan']}.yaml"))


def test_every_shipped_plan_is_listed():
    listed = {e["plan"] for e in EXAMPLES}
    shipped = {p.stem for p in (CONFIGS / "plans").glob("*.yaml")}
    assert shipped == listed


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e["plan"])
def test_example_validates_and_predicts(example):
    cluster, model, plan = paths(example)
    proc = run_cli("validate", cluster, model, plan)
    assert proc.returncode == 0, proc.stderr
    assert "fits" in proc.stdout
    proc = run_cli("predict", "--cluster", cluster, "--model", model, "--plan", plan, "--json")
    assert proc.returncode == 0, proc.stderr
    pred = json.loads(proc.stdout)
    assert set(pred) == TOP_KEYS | {"objectives"}   # hetero predict --json adds the plan's objectives
    assert pred["iteration_time_s"] > 0 and pred["tokens_per_s"] > 0 and 0 < pred["mfu"] < 1
    assert pred["fits_memory"] is True
    plan_data = yaml.safe_load(open(plan))
    assert len(pred["pipelines"]) == len(plan_data["pipelines"])
    for pp, pd in zip(pred["pipelines"], plan_data["pipelines"]):
        assert pp["replicas"] == pd.get("replicas", 1) and pp["micro_batches"] == pd["micro_batches"]
        assert [s["layers"] for s in pp["stages"]] == [s["layers"] for s in pd["stages"]]
        for stage in pp["stages"]:
            assert set(stage) == STAGE_KEYS
            assert 0 < stage["peak_memory_bytes"] <= stage["memory_capacity_bytes"]
            assert stage["forward_time_s"] > 0 and stage["backward_time_s"] > stage["forward_time_s"] * 0.5


def test_validate_checks_the_examples_index_entry_by_entry():
    """`hetero validate configs/*.yaml` takes the index as a kind of its own: one verdict per entry."""
    files = sorted(str(p) for p in CONFIGS.glob("*.yaml"))
    proc = run_cli("validate", *files)
    assert proc.returncode == 0, proc.stderr
    index = str(CONFIGS / "examples.yaml")
    lines = [line for line in proc.stdout.splitlines() if line.split()[1:2] == [index]]
    assert lines[0] == f"ok    {index} (examples) {len(EXAMPLES)} entries"
    assert lines[1:] == [f"ok    {index} examples[{i}] (example) plan {e['plan']} fits {e['cluster']} / {e['model']}"
                         for i, e in enumerate(EXAMPLES)]


def test_make_demo_validates_the_examples_index():
    """`make demo` validates the shipped configs before planning: the examples index too, and it
    passes (the recipe's `hetero validate` lines, run as written, from the repository root)."""
    import glob
    import re
    import shlex

    from conftest import REPO

    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M).group(1)
    lines = [shlex.split(line.strip()) for line in recipe.splitlines() if "hetero validate" in line]
    assert lines
    validated = []
    for words in lines:
        args = [f for w in words[words.index("validate") + 1:] for f in sorted(glob.glob(w, root_dir=REPO)) or [w]]
        validated += args
        proc = run_cli("validate", *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "configs/examples.yaml" in validated


def test_predict_says_when_the_model_costs_megatrons_unfused_attention(tmp_path):
    """The default `attention: unfused` is Megatron's (what the vTrain runs measured); hetero's
    runtime runs SDPA, so the table says how to predict hetero's own runs, and says nothing once
    the model file asks for fused attention."""
    cluster, plan = str(CONFIGS / "clusters" / "local-cpu.yaml"), str(CONFIGS / "plans" / "local-cpu-tiny.yaml")
    model = yaml.safe_load((CONFIGS / "models" / "tiny.yaml").read_text())
    assert "attention" not in model
    unfused = run_cli("predict", "--cluster", cluster, "--model", str(CONFIGS / "models" / "tiny.yaml"), "--plan", plan)
    assert unfused.returncode == 0 and "write `attention: fused`" in " ".join(unfused.stdout.split()), unfused.stdout
    fused_file = tmp_path / "tiny-fused.yaml"
    fused_file.write_text(yaml.safe_dump({**model, "attention": "fused"}))
    fused = run_cli("predict", "--cluster", cluster, "--model", str(fused_file), "--plan", plan)
    assert fused.returncode == 0 and "attention: unfused" not in fused.stdout, fused.stdout

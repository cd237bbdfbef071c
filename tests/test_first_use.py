"""What a first user meets: a plan that cannot fit is stopped (validate, launch) or flagged
(predict's exit status); dry runs on clusters without hosts; node slots on loopback hosts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import CONFIGS
from helpers import cluster_dict, emulated_device, group_dict, local_cluster


def _cli(capsys, *argv: str):
    """``hetero ARGV`` in this process: (exit status, stdout, stderr)."""
    from types import SimpleNamespace

    from hetero.cli import main

    code = main(list(argv))
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

TINY_MEMORY = cluster_dict(group_dict("fast", "tinyemu", 1, 2), name="small",
                           devices={"tinyemu": emulated_device("emu-a", memory="1 MiB")})
PLAN = {"global_batch_size": 8, "micro_batch_size": 4,
        "pipelines": [{"replicas": 2, "micro_batches": 1, "stages": [{"group": "fast", "layers": [0, 4]}]}]}


def _write(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_plan_that_cannot_fit_is_refused_by_validate_and_launch_and_flagged_by_predict(tmp_path, capsys):
    cluster, plan = _write(tmp_path / "c.yaml", TINY_MEMORY), _write(tmp_path / "p.yaml", PLAN)
    model = str(CONFIGS / "models" / "tiny.yaml")
    need = "p.yaml: pipelines[0].stages[0]: does not fit: the stage (fast, tp 1, layers [0, 4)) needs "
    proc = _cli(capsys, "validate", "--cluster", cluster, "--model", model, plan)
    assert proc.returncode == 1 and need in proc.stderr and "holds 1 MiB" in proc.stderr, proc.stdout + proc.stderr
    assert "fits" not in proc.stdout.split("p.yaml")[1].splitlines()[0]
    inputs = ["--cluster", cluster, "--model", model, "--plan", plan]
    run_dir = tmp_path / "run"
    for extra in (["--dry-run"], ["--steps", "1", "--run-dir", str(run_dir)]):
        proc = _cli(capsys, "launch", *inputs, *extra)
        assert proc.returncode == 1 and need in proc.stderr and "nothing was started" in proc.stderr, proc.stderr
        assert "--skip-memory-check" in proc.stderr and "Traceback" not in proc.stderr and not run_dir.exists()
    proc = _cli(capsys, "launch", *inputs, "--dry-run", "--skip-memory-check", "--run-dir", str(run_dir))
    assert proc.returncode == 0 and "--nproc-per-node=2" in proc.stdout, proc.stderr
    proc = _cli(capsys, "predict", *inputs)   # the full report, then the verdict on its last line and in the status
    assert proc.returncode == 3 and "iteration" in proc.stdout, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("does not fit: 1 stage needs more memory")
    assert "MiB / 1 MiB" in proc.stdout and "0.00 GiB" not in proc.stdout   # units follow the size
    proc = _cli(capsys, "predict", *inputs, "--json")
    assert proc.returncode == 3 and json.loads(proc.stdout)["fits_memory"] is False
    # the same files with room: every command is content
    roomy = _write(tmp_path / "roomy.yaml", {**TINY_MEMORY, "devices": {"tinyemu": {"base": "cpu", "vendor": "emu-a"}}})
    assert _cli(capsys, "predict", "--cluster", roomy, "--model", model, "--plan", plan).returncode == 0
    proc = _cli(capsys, "validate", "--cluster", roomy, "--model", model, plan)
    assert proc.returncode == 0 and "fits small / tiny" in proc.stdout, proc.stderr


def test_a_dry_run_over_machines_without_hosts_shows_commands_each_machine_can_run(tmp_path, capsys):
    """A cluster of GPU nodes without `hosts:`: the dry run shows every node slot's commands with a
    placeholder for the rendezvous address (a launch refuses, see test_runtime), names this
    interpreter rather than a bare `python`, and says what each machine needs besides: the run
    file at its path, or the `hetero launch --node-rank R` call (this call's options) for its slot."""
    import sys

    gpus = cluster_dict(group_dict("a100", "A100-SXM4-80GB", 2, 2), name="gpus")
    plan = {**PLAN, "micro_batch_size": 2,
            "pipelines": [{"replicas": 4, "micro_batches": 1, "stages": [{"group": "a100", "layers": [0, 4]}]}]}
    cluster, plan_file = _write(tmp_path / "c.yaml", gpus), _write(tmp_path / "p.yaml", plan)
    model = str(CONFIGS / "models" / "tiny.yaml")
    out = _cli(capsys, "launch", "--cluster", cluster, "--model", model, "--plan", plan_file, "--steps", "3",
               "--dry-run", "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "rendezvous static at <address of node slot 0>:29500" in text
    assert "names no host for node slot 0" in text and "each machine needs" in text
    commands = [line for line in text.splitlines() if "-m hetero.runtime.torchrun_loopback" in line]
    assert len(commands) == 2 and all(line.startswith(sys.executable + " -m") for line in commands), commands
    assert str(tmp_path / "run" / "run.json") in text.split("each machine needs", 1)[1].splitlines()[0]
    calls = [line for line in text.splitlines() if line.startswith("# or, on that machine: ")]
    assert [c.rsplit(" ", 1)[1] for c in calls] == ["0", "1"]
    for call in calls:
        assert f"{sys.executable} -m hetero launch --cluster {cluster} --model {model}" in call and "--steps 3" in call
        assert "--dry-run" not in call and "--master-addr '<address of node slot 0>' --master-port 29500" in call


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_node_slots_on_loopback_hosts_each_started_by_a_call_of_their_own_train_as_one_call(tmp_path):
    """Groups on hosts 127.0.0.1 and 127.0.0.2 are two node slots of this machine: started by one
    `hetero launch --node-rank R` call each (as on two machines, meeting at the rendezvous), they
    train with the losses of one call that starts both slots itself."""
    import subprocess
    import sys
    import time

    from _spawn import end_launcher, free_port, run_launcher
    from helpers import GPT, ROOT, leftover as _leftover

    cluster = local_cluster(devices=1, slowdown=None, hosts=(["127.0.0.1"], ["127.0.0.2"]), name="loop")
    plan = {"global_batch_size": 8, "micro_batch_size": 2,
            "pipelines": [{"micro_batches": 4, "stages": [{"group": "fast", "layers": [0, 2]},
                                                          {"group": "slow", "layers": [2, 4]}]}]}
    base = [sys.executable, "-m", "hetero", "launch", "--cluster", _write(tmp_path / "c.yaml", cluster),
            "--model", _write(tmp_path / "m.yaml", GPT), "--plan", _write(tmp_path / "p.yaml", plan),
            "--steps", "2", "--lr", "1e-2", "--timeout", "30", "--quiet"]

    def call(i: int, *extra: str) -> list[str]:
        return [*base, "--run-dir", str(tmp_path / f"run{i}"), "--summary", str(tmp_path / f"s{i}.json"), *extra]

    port = str(free_port())
    procs = [subprocess.Popen(call(r, "--node-rank", str(r), "--master-port", port), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True) for r in (0, 1)]
    outputs = []
    try:
        deadline = time.time() + 150
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.time())))
    finally:
        for r, p in enumerate(procs):
            end_launcher(p, str(tmp_path / f"run{r}"))
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert not _leftover(tmp_path / "run0") and not _leftover(tmp_path / "run1")
    one = run_launcher(call(2), 150, marker=str(tmp_path / "run2"), cwd=ROOT)
    assert one.returncode == 0, one.stderr[-3000:]
    separate, together = (json.loads((tmp_path / f"s{i}.json").read_text()) for i in (0, 2))
    assert separate["steps"] == together["steps"] == 2
    assert separate["losses"] == together["losses"] and separate["grad_norms"] == together["grad_norms"]
    assert not (tmp_path / "s1.json").exists()   # rank 0 (node slot 0's call) writes the summary


def test_a_file_that_repeats_a_mistake_prints_a_capped_list(tmp_path, capsys):
    """A group alias used 300 times with one bad field: 300 problems, of which the first 50 are
    printed, then how many more there are (validate, and every other command's file errors)."""
    from hetero.cli._common import MAX_PROBLEMS

    lines = ["name: x", "bad: &b {name: g, device: cpu, nodes: 0, devices_per_node: 1}", "groups:"]
    path = tmp_path / "flood.yaml"
    path.write_text("\n".join(lines + ["  - *b"] * 300) + "\n")
    for argv in (["validate", str(path)], ["devices", "--cluster", str(path)]):
        out = _cli(capsys, *argv)
        errors = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(errors) == MAX_PROBLEMS + 1, (argv, errors[-3:])
        assert errors[-1].startswith("error: ... and 251 more problems not shown"), errors[-1]


def test_a_cpu_cluster_without_a_profile_is_predicted_with_a_warning(capsys):
    """The suite's profile cache is empty (conftest): CPU devices are predicted from generic figures,
    and predict and plan say so on stderr, --json too; a GPU cluster's prediction says nothing."""
    cpu = ["--cluster", str(CONFIGS / "clusters" / "local-cpu.yaml"), "--model", str(CONFIGS / "models" / "tiny.yaml")]
    out = _cli(capsys, "predict", *cpu, "--plan", str(CONFIGS / "plans" / "local-cpu-tiny.yaml"), "--json")
    assert out.returncode == 0 and "has no profile yet" in out.stderr and "`hetero profile`" in out.stderr
    out = _cli(capsys, "plan", *cpu, "--global-batch-size", "8", "--top-k", "1", "--no-progress")
    assert out.returncode == 0 and "has no profile yet" in out.stderr, out.stderr
    gpu = ["--cluster", str(CONFIGS / "clusters" / "h100-a100.yaml"), "--model", str(CONFIGS / "models" / "llama3-8b.yaml"),
           "--plan", str(CONFIGS / "plans" / "h100-a100-llama3-8b.yaml")]
    out = _cli(capsys, "predict", *gpu, "--json")
    assert out.returncode == 0 and "profile" not in out.stderr, out.stderr


def test_tensor_parallelism_over_whole_nodes_is_predicted_over_the_network_and_not_launched(tmp_path, capsys):
    """tp 16 over two 8-GPU nodes (a layout Megatron runs): validate and predict take it with a
    warning, its all-reduces charged on the inter-node links (a slower network, a slower stage);
    launch refuses it before anything starts; tp 12 (not whole nodes) stays an error."""
    import hetero

    cluster = cluster_dict(group_dict("h100", "H100-SXM5-80GB", 2, 8), name="h16")
    plan = {"global_batch_size": 16, "micro_batch_size": 1,
            "pipelines": [{"micro_batches": 16, "stages": [{"group": "h100", "tp": 16, "layers": [0, 32]}]}]}
    c, p = _write(tmp_path / "c.yaml", cluster), _write(tmp_path / "p.yaml", plan)
    model = str(CONFIGS / "models" / "llama2-7b.yaml")
    out = _cli(capsys, "validate", "--cluster", c, "--model", model, p)
    assert out.returncode == 0 and "tp=16 spans 2 nodes" in out.stderr and "refuses this plan" in out.stderr, out
    out = _cli(capsys, "predict", "--cluster", c, "--model", model, "--plan", p)
    assert out.returncode == 0 and "tp=16 spans 2 nodes" in out.stderr, out.stderr
    out = _cli(capsys, "launch", "--cluster", c, "--model", model, "--plan", p, "--dry-run")
    assert out.returncode == 1 and "tp=16 spans 2 nodes" in out.stderr and "HETERO_RUN_SPEC" not in out.stdout

    def stage_time(bandwidth: str) -> float:
        net = {**cluster, "network": {"inter_node": {"bandwidth": bandwidth, "latency": "5 us"}}}
        s = hetero.predict(hetero.load_cluster(net), hetero.load_model(model), hetero.load_plan(plan)).stage(0, 0)
        return s.forward_time_s + s.backward_time_s

    assert stage_time("10 GB/s") > 1.5 * stage_time("400 GB/s")
    out = _cli(capsys, "validate", "--cluster", c, "--model", model,
               _write(tmp_path / "p12.yaml", {**plan, "pipelines": [{"micro_batches": 16, "stages": [
                   {"group": "h100", "tp": 12, "layers": [0, 32]}]}]}))
    assert out.returncode == 1 and "exceeds the 8 devices of one node" in out.stderr, out.stderr

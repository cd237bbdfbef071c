"""RunOptions is the one validated run configuration: every problem at once, from the Python API and the
CLI alike, and the CLI's help is the fields' documentation."""
import pytest

from conftest import CONFIGS

FILES = [str(CONFIGS / "clusters" / "local-cpu.yaml"), str(CONFIGS / "models" / "tiny.yaml"),
         str(CONFIGS / "plans" / "local-cpu-tiny.yaml")]


def test_every_bad_option_is_named_in_one_error():
    from hetero.errors import HeteroError
    from hetero.runtime.options import OptionsError, RunOptions

    with pytest.raises(OptionsError) as e:
        RunOptions(steps=0, lr=-1)
    assert isinstance(e.value, HeteroError) and isinstance(e.value, ValueError)
    assert [p.path for p in e.value.problems] == ["steps", "lr"]
    assert all(p.fix for p in e.value.problems)
    text = str(e.value)
    assert "steps=0" in text and "lr=-1" in text and "fix: give a positive learning rate" in text
    with pytest.raises(OptionsError) as e:
        RunOptions(engine="megatron", allocator="arena", inject_failure=(0, 1), clip=float("nan"), threads=True)
    assert {p.path for p in e.value.problems} == {"engine", "allocator", "inject_failure", "clip", "threads"}
    assert "one of native, deepspeed" in str(e.value)
    RunOptions(clip=0.0, loss_scale=2.0 ** 24, inject_failure=(1, 0))   # 0: no clipping; in range


def test_the_python_api_checks_before_anything_starts():
    import hetero.runtime
    from hetero.runtime.options import OptionsError

    with pytest.raises(OptionsError) as e:
        hetero.runtime.launch(*FILES, steps=0, lr=-1)
    assert [p.path for p in e.value.problems] == ["steps", "lr"]


def test_the_cli_names_each_flag_and_exits_1(capsys):
    from hetero.cli import main

    rc = main(["launch", "--cluster", FILES[0], "--model", FILES[1], "--plan", FILES[2], "--dry-run",
               "--steps", "0", "--lr", "-1", "--timeout", "0", "--inject-failure", "0:2", "--machine-lost-after", "0.1"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    assert "error: --steps 0: out of range (fix: give at least 1 step" in err
    assert "error: --lr -1.0: out of range" in err and "error: --timeout 0.0: out of range" in err
    assert "error: --inject-failure 0:2: out of range (fix: STEP is 1-based" in err
    assert "error: --machine-lost-after 0.1: out of range (fix: give seconds >= 0.5" in err


def test_every_field_is_documented_and_the_cli_help_is_that_documentation(capsys):
    from hetero.cli import main
    from hetero.runtime.options import FIELDS, field_docs

    docs = field_docs()
    assert set(docs) == set(FIELDS) and all(len(d) > 10 for d in docs.values())
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in ("lr", "bucket_mb", "allocator", "timeout_s"):
        assert docs[name] in help_text, name
    assert "hetero.runtime.overlap" in help_text and ":mod:" not in help_text

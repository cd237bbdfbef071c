"""One error root: every error the project raises on purpose is a HeteroError, and the kinds that
were ValueError / RuntimeError before stay so (callers catching those see no change)."""
from __future__ import annotations

import pytest

from hetero.comm.errors import HeteroCommError, HeteroCommTimeout
from hetero.errors import HeteroError
from hetero.predictor.profiles import ProfileError, read_records
from hetero.specs.errors import Problem, SpecError
from hetero.specs.io import InputFileError


@pytest.mark.parametrize("cls, legacy", [(SpecError, ValueError), (InputFileError, ValueError),
                                         (ProfileError, ValueError), (HeteroCommError, RuntimeError),
                                         (HeteroCommTimeout, TimeoutError)])
def test_every_error_derives_from_the_root_and_keeps_its_old_base(cls, legacy):
    assert issubclass(cls, HeteroError)
    assert issubclass(cls, legacy)


def test_a_bad_profile_is_caught_as_hetero_error(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("op,device,latency_ms\nconv,cpu,1.0\n")
    with pytest.raises(HeteroError, match="unknown op 'conv'"):
        read_records(path)


def test_the_cli_prints_each_kind_in_one_line_without_a_traceback(capsys, monkeypatch):
    """The CLI catches the root: a SpecError lists its problems, an InputFileError its fix, and any
    other HeteroError (here a communicator error) its message; exit status 1 for all."""
    from hetero import cli
    from hetero.cli import devices

    def failing(error):
        def run(args):
            raise error
        return run

    cases = [(SpecError([Problem("groups", "missing", "add one", "c.yaml")]), "error: c.yaml: groups: missing (fix: add one)"),
             (InputFileError("x.yaml: not UTF-8", "save it as UTF-8"), "error: x.yaml: not UTF-8 (fix: save it as UTF-8)"),
             (HeteroCommError("all_reduce failed: rank 3 left", op="all_reduce"), "error: all_reduce failed: rank 3 left")]
    for error, line in cases:
        monkeypatch.setattr(devices, "run", failing(error))   # read when the parser is built
        assert cli.main(["devices"]) == 1
        err = capsys.readouterr().err
        assert err.strip() == line
        assert "Traceback" not in err

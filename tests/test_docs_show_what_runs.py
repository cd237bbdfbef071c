"""What the docs show is what the code writes: the model file import-hf writes (docs/huggingface.md),
the extras `make setup` installs (docs/getting-started.md)."""
from __future__ import annotations

import re

from conftest import REPO


def test_the_model_file_shown_is_the_one_written(tmp_path):
    """docs/huggingface.md shows model.yaml under `cat`: the file ModelSpec.save writes for it, one
    field a line (it showed import-hf's summary line there, and the file was one flow mapping)."""
    import hetero

    text = (REPO / "docs" / "huggingface.md").read_text()
    shown = re.search(r"`cat hf-demo/tiny-llama/model.yaml`.*?```yaml\n(.*?)```", text, re.S).group(1)
    (tmp_path / "shown.yaml").write_text(shown)
    hetero.load_model(tmp_path / "shown.yaml").save(tmp_path / "written.yaml")
    assert (tmp_path / "written.yaml").read_text() == shown


def test_a_plan_keeps_its_layer_ranges_inline(tmp_path):
    import hetero
    from conftest import CONFIGS

    hetero.load_plan(CONFIGS / "plans" / "local-cpu-tiny.yaml").save(tmp_path / "p.yaml")
    written = (tmp_path / "p.yaml").read_text()
    assert "global_batch_size: 16\n" in written and "layers: [0, 4]" in written, written


def test_the_extras_named_are_the_ones_make_setup_installs():
    extras = re.search(r"^EXTRAS \?= (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1).split(",")
    text = (REPO / "docs" / "getting-started.md").read_text()
    said = re.search(r"`make setup` installs the (.*?) extras", text, re.S).group(1)
    assert sorted(re.findall(r"`(\w+)`", said)) == sorted(extras), (said, extras)

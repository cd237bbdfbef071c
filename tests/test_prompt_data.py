"""Prompt/completion data (--data FILE.jsonl, hetero.runtime.prompt_data): lines checked with their numbers
before any process starts, the loss on completion tokens only, and the step's loss the mean over the
global batch's loss tokens whatever the plan (micro-batches, pipeline and tensor parallelism, replicas)."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import GPT, LR, STEPS, launch as _launch, write_yaml as _write
from helpers import plan_dict as _plan

LINES = [{"prompt": "Q: 2+2? A:", "completion": " 4"},
         {"prompt": "Translate 'chat':", "completion": " cat, a pet"},
         {"text": "the quick brown fox jumps"},
         {"prompt": "", "completion": "no prompt here at all"},
         {"prompt": "A longer prompt, room for", "completion": " few"},
         {"prompt": "x", "completion": "yz", "id": 7},   # other keys are ignored
         {"text": "ab"},
         {"prompt": "Capital of France?", "completion": " Paris"},
         {"prompt": "Say hi", "completion": " hi!"},
         {"text": "0123456789abcdefghijklmnopqrstuv"}]   # 32 bytes: seq_length + 1 = 33 fits


def _jsonl(tmp_path, lines=LINES, name="sft.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_targets_carry_loss_on_completion_tokens_only(tmp_path):
    """Bytes tokenizer: a prompt's and the padding's targets are IGNORE_INDEX, the completion's are its
    bytes (target k predicts token k + 1); a text line carries loss on every token but the first."""
    from hetero.runtime.data import IGNORE_INDEX, data_source

    src = data_source(512, 32, 0, _jsonl(tmp_path))
    seen = set()
    for i in range(len(LINES)):
        batch = src.batch(i, 1)
        line = src.line_of(i)
        seen.add(line.line)
        item = LINES[line.line - 1]
        prompt = item.get("prompt", "").encode()
        whole = prompt + item.get("completion", item.get("text", "")).encode()
        x, y = batch.inputs[0].tolist(), batch.targets[0].tolist()
        assert x[:len(whole)] == list(whole) and set(x[len(whole):]) <= {0}
        first = max(1, len(prompt))     # the first token that a position predicts and that carries loss
        assert y[:first - 1] == [IGNORE_INDEX] * (first - 1)
        assert y[first - 1:len(whole) - 1] == list(whole[first:])
        assert y[len(whole) - 1:] == [IGNORE_INDEX] * (32 - len(whole) + 1)
        assert batch.loss_tokens == src.loss_tokens(i, 1) == len(whole) - first
    assert seen == set(range(1, len(LINES) + 1))   # one epoch takes every line once
    assert src.loss_tokens(0, 4) == sum(src.batch(0, 4).targets.ne(IGNORE_INDEX).sum(1).tolist())
    again = data_source(512, 32, 0, _jsonl(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(src.batch(3, 9), again.batch(3, 9)))   # (seed, i) only
    assert [data_source(512, 32, 1, _jsonl(tmp_path)).line_of(i).line for i in range(10)] != \
        [src.line_of(i).line for i in range(10)]


def test_the_loss_ignores_prompt_tokens_and_is_the_mean_over_the_batch_loss_tokens(tmp_path):
    """loss_sum over micro-batches divided by the step's loss tokens is the token mean of the whole
    batch (not a mean of micro-batch means); a masked position's logits get no gradient."""
    import torch.nn.functional as F

    from hetero.runtime.data import data_source
    from hetero.runtime.model import loss_sum

    src = data_source(512, 32, 0, _jsonl(tmp_path))
    batch = src.batch(0, 8)
    logits = torch.randn(8, 32, 512, generator=torch.Generator().manual_seed(0), requires_grad=True)
    keep = batch.targets != -100
    mean = F.cross_entropy(logits[keep], batch.targets[keep])
    split = sum(loss_sum(logits[k:k + 2], batch.targets[k:k + 2]) for k in range(0, 8, 2)) / src.loss_tokens(0, 8)
    assert float(split.detach()) == pytest.approx(float(mean.detach()), rel=1e-6)
    split.backward()
    assert float(logits.grad[~keep].abs().max()) == 0.0 and float(logits.grad[keep].abs().max()) > 0


def test_the_reference_loss_does_not_depend_on_how_the_batch_is_split(tmp_path):
    """Lines of different loss-token counts: chunks of 3 and 8 samples give the same losses (a mean
    of micro-batch means would not)."""
    from hetero.runtime.reference import reference_losses

    data, small = _jsonl(tmp_path), dict(GPT, num_layers=1, hidden_size=32)
    whole = reference_losses(small, 0, 2, 8, chunk=8, lr=LR, data=data)
    assert reference_losses(small, 0, 2, 8, chunk=3, lr=LR, data=data) == pytest.approx(whole, rel=1e-5)


@pytest.mark.parametrize("line,needle", [
    ('{"prompt": "a", "completion": "b"', "line 3: not JSON"),
    ('["prompt", "completion"]', 'line 3: neither {"prompt", "completion"} nor {"text"}'),
    ('{"prompt": "a", "answer": "b"}', "line 3: neither"),
    ('{"text": "a", "prompt": "b", "completion": "c"}', "line 3: neither"),
    ('{"prompt": 1, "completion": "c"}', "line 3: neither"),
    (json.dumps({"prompt": "p" * 30, "completion": "c" * 4}), "line 3: 34 tokens, more than one sample holds "
                                                              "(seq_length + 1 = 33)"),
    ('{"prompt": "only a prompt", "completion": ""}', "line 3: no token carries loss"),
])
def test_a_bad_line_is_named_with_its_number(tmp_path, line, needle):
    from hetero.errors import HeteroError
    from hetero.runtime.data import check_data

    path = _jsonl(tmp_path, [LINES[0], "", line, LINES[1]])   # a blank line is skipped but counted
    with pytest.raises(HeteroError) as e:
        check_data(path, 512, 32)
    assert str(e.value).startswith(f"--data {path}: {needle}") and "(fix: " in str(e.value), str(e.value)


def test_bad_data_is_refused_before_any_process_starts(tmp_path, capsys):
    from hetero.cli import main
    from helpers import CLUSTER

    plan = _plan([{"micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 4]}]}], gbs=4)
    files = ["--cluster", _write(tmp_path, "c.yaml", CLUSTER), "--model", _write(tmp_path, "m.yaml", GPT),
             "--plan", _write(tmp_path, "p.yaml", plan)]
    bad = _jsonl(tmp_path, [LINES[0], "not json"], "bad.jsonl")
    rc = main(["launch", *files, "--run-dir", str(tmp_path / "run"), "--data", bad])
    err = capsys.readouterr().err
    assert rc == 1 and f"error: --data {bad}: line 2: not JSON" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("rank*"))
    ok = ["launch", *files, "--dry-run", "--run-dir", str(tmp_path / "dry"), "--data", _jsonl(tmp_path)]
    assert main([*ok, "--tokenizer", "bytes"]) == 0, capsys.readouterr().err   # the default, by name
    capsys.readouterr()
    small = dict(GPT, vocab_size=200)
    files[3] = _write(tmp_path, "m.yaml", small)
    rc = main(["launch", *files, "--dry-run", "--data", _jsonl(tmp_path)])
    assert rc == 1 and "vocab_size is 200, but UTF-8 bytes need ids up to 255" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_pp2_and_tp2_run_on_prompt_data_matches_the_single_process_run(tmp_path):
    """Two pipelines (one stage of tp 2: the vocabulary-parallel loss; two stages of one device each, 3
    micro-batches) on lines of different prompt and completion lengths: the losses and gradient norms
    of the single-process reference."""
    from hetero.runtime.reference import reference_run

    data = _jsonl(tmp_path)
    plan = _plan([{"micro_batches": 1, "stages": [{"group": "fast", "tp": 2, "layers": [0, 4]}]},
                  {"micro_batches": 3, "stages": [{"group": "slow", "layers": [0, 1]},
                                                  {"group": "slow", "layers": [1, 4]}]}])
    summary, _ = _launch(tmp_path, GPT, plan, "--data", data)
    losses, norms = reference_run(GPT, 0, STEPS, 8, lr=LR, data=data)
    assert summary["losses"] == pytest.approx(losses, rel=1e-3), (summary["losses"], losses)
    assert summary["grad_norms"] == pytest.approx(norms, rel=1e-3)
    tokens_mean = reference_run(GPT, 0, STEPS, 8, lr=LR)[0]   # the same model on the synthetic stream differs
    assert summary["losses"] != pytest.approx(tokens_mean, rel=1e-3)


def test_a_hugging_face_tokenizer_adds_its_begin_token_to_the_prompt_and_its_end_token(tmp_path, capsys):
    """--tokenizer: the prompt encoded with the tokenizer's special tokens (its post-processor's <s>), the
    completion without, then the end token tokenizer_config.json names; the launcher passes the tokenizer
    to the workers instead of caching token ids for a .jsonl."""
    from hetero.cli import main
    from hetero.runtime.data import IGNORE_INDEX, data_source
    from helpers import CLUSTER
    from helpers.hf import word_tokenizer

    folder = word_tokenizer(tmp_path / "tok", 20)
    data = _jsonl(tmp_path, [{"prompt": "w1 w2", "completion": "w3"}, {"text": "w4 w5 w6"}])
    src = data_source(64, 8, 0, data, str(folder))
    rows = {src.line_of(i).line: src.batch(i, 1) for i in range(2)}
    assert rows[1].inputs[0].tolist() == [1, 4, 5, 6, 2, 0, 0, 0]          # <s> w1 w2 | w3 </s>, padding
    assert rows[1].targets[0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 6, 2] + [IGNORE_INDEX] * 4
    assert rows[2].targets[0].tolist() == [7, 8, 9, 2] + [IGNORE_INDEX] * 4   # a text: every token after <s>
    plan = _plan([{"micro_batches": 2, "stages": [{"group": "fast", "layers": [0, 4]}]}], gbs=4)
    model = dict(GPT, vocab_size=64, seq_length=8)
    rc = main(["launch", "--cluster", _write(tmp_path, "c.yaml", CLUSTER), "--model", _write(tmp_path, "m.yaml", model),
               "--plan", _write(tmp_path, "p.yaml", plan), "--dry-run", "--run-dir", str(tmp_path / "run"),
               "--data", data, "--tokenizer", str(folder)])
    assert rc == 0, capsys.readouterr().err
    spec = json.loads((tmp_path / "run" / "run.json").read_text())
    assert spec["options"]["tokenizer"] == str(folder / "tokenizer.json") and spec["options"]["data"] == data
    assert not list(tmp_path.glob("sft.jsonl.tok-*"))   # no token cache for prompt/completion lines


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_deepspeed_engine_on_prompt_data_with_a_schedule_matches_the_reference(tmp_path):
    """DeepSpeed ZeRO-1 over two replicas of unequal micro-batch counts: the same masked-token mean and the
    same cosine schedule as the single-process reference."""
    pytest.importorskip("deepspeed")
    from hetero.runtime.lr_schedule import lr_at
    from hetero.runtime.reference import reference_run

    data = _jsonl(tmp_path)
    plan = _plan([{"micro_batches": 1, "stages": [{"group": "fast", "layers": [0, 4]}]},
                  {"micro_batches": 3, "stages": [{"group": "slow", "layers": [0, 4]}]}], zero_stage=1)
    flags = ("--lr-schedule", "cosine", "--warmup-steps", "1", "--min-lr", str(LR / 10))
    summary, _ = _launch(tmp_path, GPT, plan, "--engine", "deepspeed", "--data", data, *flags, timeout=220)
    losses, norms = reference_run(GPT, 0, STEPS, 8, lr=LR, data=data, lr_schedule="cosine", warmup_steps=1,
                                  min_lr=LR / 10)
    assert summary["engine"] == "deepspeed"
    assert summary["lrs"] == pytest.approx([lr_at(t, STEPS, LR, "cosine", 1, LR / 10) for t in range(STEPS)])
    assert summary["losses"] == pytest.approx(losses, rel=1e-3), (summary["losses"], losses)
    assert summary["grad_norms"] == pytest.approx(norms, rel=1e-3)

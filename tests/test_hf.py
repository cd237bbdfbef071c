"""Hugging Face models in and out (offline: tiny random models built by transformers and saved with
save_pretrained): import-hf -> export-hf gives back every tensor, the runtime computes transformers'
logits and first-step loss (PP2 x TP2 over two emulated vendors), each rank reads only its share,
bad inputs fail with one line and leave nothing behind, and --tokenizer caches token ids."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from helpers import CLUSTER, ROOT, assert_no_leftover, leftover as _leftover   # CLUSTER: 2 vendors x 2 CPUs
from helpers.hf import assert_logits_equal_transformers

VOCAB = 300
PP2_TP2 = {"global_batch_size": 2, "micro_batch_size": 1,
           "pipelines": [{"micro_batches": 2, "stages": [{"group": "fast", "tp": 2, "layers": [0, 1]},
                                                         {"group": "slow", "tp": 2, "layers": [1, 2]}]}]}


def _transformers():
    """transformers, imported only where a test needs it (not in the spawned workers, which import this
    module to find their function)."""
    return pytest.importorskip("transformers")


def _save_llama(path: Path) -> None:
    """Grouped-query attention (4 heads, 2 kv), untied head, a non-default rotary base, sharded files."""
    transformers = _transformers()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   tie_word_embeddings=False, rope_theta=50000.0, rms_norm_eps=1e-6)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="60KB")


def _save_gpt2(path: Path) -> None:
    """Conv1D weights, fused q/k/v, tied head, one safetensors file."""
    transformers = _transformers()
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)


def _save_qwen2(path: Path) -> None:
    """Llama blocks with q/k/v biases (random, so a wrong row order shows), tied head."""
    transformers = _transformers()
    torch.manual_seed(2)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_()
    model.save_pretrained(path)


def _save_mistral(path: Path) -> None:
    """Llama blocks with one kv head and a sliding window as long as the sequence (the same attention)."""
    transformers = _transformers()
    torch.manual_seed(3)
    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=16,
                                     sliding_window=16, tie_word_embeddings=False)
    transformers.MistralForCausalLM(cfg).save_pretrained(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {"llama": root / "llama", "gpt2": root / "gpt2", "qwen2": root / "qwen2"}
    _save_llama(out["llama"])
    _save_gpt2(out["gpt2"])
    _save_qwen2(out["qwen2"])
    out["mistral"] = root / "mistral"
    _save_mistral(out["mistral"])
    assert (out["llama"] / "model.safetensors.index.json").exists() and (out["gpt2"] / "model.safetensors").exists()
    return out


def _cli(*argv: str) -> int:
    from hetero.cli import main

    return main(list(argv))


def _hf_model(path):
    return _transformers().AutoModelForCausalLM.from_pretrained(path).eval()


# ---------------------------------------------------------------------------- in and out


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
def test_import_then_export_gives_back_every_tensor(models, tmp_path, kind):
    """With --base (import-hf's hf folder) and, for qwen2, without: its q/k/v biases alone make the
    written config a Qwen2 one."""
    out, back = tmp_path / "imported", tmp_path / "exported"
    assert _cli("import-hf", str(models[kind]), "-o", str(out)) == 0
    assert sorted(os.listdir(out)) == ["checkpoint", "hf", "model.yaml"]
    base = [] if kind == "qwen2" else ["--base", str(out / "hf")]
    assert _cli("export-hf", "--model", str(out / "model.yaml"), "--checkpoint", str(out / "checkpoint"),
                "-o", str(back), "--max-shard-size", "100KB", *base) == 0
    assert (back / "model.safetensors.index.json").exists()   # sharded: the index transformers follows
    exported_model = _hf_model(back)
    assert type(exported_model).__name__ == type(_hf_model(models[kind])).__name__
    original, exported = _hf_model(models[kind]).state_dict(), exported_model.state_dict()
    assert sorted(original) == sorted(exported)
    for name, t in original.items():
        assert torch.equal(t, exported[name]), name


def test_the_imported_checkpoint_loads_like_a_saved_one(models, tmp_path):
    """import-hf's checkpoint is a plan-independent one: a stage loads it with load_checkpoint (what
    launch --load DIR runs) and holds the folder's own weights, at step 0."""
    import hetero
    from hetero.hf.weights import load_stage_weights
    from hetero.runtime.checkpoint import load_checkpoint
    from hetero.runtime.grads import make_optimizer
    from hetero.runtime.model import build_stage

    assert _cli("import-hf", str(models["gpt2"]), "-o", str(tmp_path / "gpt2")) == 0
    spec = hetero.load_model(str(tmp_path / "gpt2" / "model.yaml"))
    loaded, direct = build_stage(spec, (1, 2), False, True, 0), build_stage(spec, (1, 2), False, True, 1)
    with warnings.catch_warnings():   # no process group: torch says it loads as a single process
        warnings.simplefilter("ignore")
        step = load_checkpoint(str(tmp_path / "gpt2" / "checkpoint"), loaded,
                               make_optimizer(loaded.parameters(), 1e-3, 0.0), spec.num_layers)
    load_stage_weights(str(models["gpt2"]), direct, spec)
    assert step == 0
    for (name, p), q in zip(loaded.named_parameters(), direct.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2", "mistral"])
def test_runtime_logits_equal_transformers(models, kind):
    """Rotary rows, Conv1D transposes and fused q/k/v converted exactly: same logits."""
    assert_logits_equal_transformers(models[kind], VOCAB)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_pipeline_stage_reads_its_layers_only(models, kind):
    """Bytes read per stage are exactly its parameters' bytes in the files; the stages together read
    the model once (plus the tied embedding the last stage keeps a copy of)."""
    from hetero.hf.config import read_hf_config
    from hetero.hf.weights import load_stage_weights
    from hetero.runtime.model import build_stage

    spec = read_hf_config(str(models[kind])).spec
    stages = [build_stage(spec, (0, 1), True, False, 0), build_stage(spec, (1, 2), False, True, 0)]
    read = [load_stage_weights(str(models[kind]), s, spec) for s in stages]
    share = [sum(p.numel() * 4 for p in s.parameters()) for s in stages]
    assert read == share
    from safetensors import safe_open

    files = [f for f in os.listdir(models[kind]) if f.endswith(".safetensors")]
    total = 0
    for f in files:
        with safe_open(str(models[kind] / f), "pt") as h:
            total += sum(math.prod(h.get_slice(k).get_shape()) * 4 for k in h.keys())
    tied = VOCAB * spec.hidden_size * 4 if spec.tie_embeddings else 0
    assert sum(read) == total + tied


def _tp_worker(rank, world, jobs):
    """One of two tp ranks of each whole model in ``jobs`` (folder, model dict): load, report bytes read
    and the bytes it holds, and check every local shard against a load without tensor parallelism."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = [_tp_load(folder, model_dict) for folder, model_dict in jobs]
    dist.destroy_process_group()
    return out


def _tp_load(folder, model_dict):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import hetero
    from hetero.hf.weights import load_stage_weights
    from hetero.runtime.grads import full_tensor
    from hetero.runtime.model import apply_tensor_parallel, build_stage

    spec = hetero.load_model(model_dict)
    mine = build_stage(spec, (0, 2), True, True, 0)
    apply_tensor_parallel(mine, DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    read = load_stage_weights(folder, mine, spec)
    whole = build_stage(spec, (0, 2), True, True, 1)
    load_stage_weights(folder, whole, spec)
    reference = dict(whole.named_parameters())
    held = 0
    for name, p in mine.named_parameters():
        assert torch.equal(full_tensor(p), reference[name]), name
        held += (p.to_local() if hasattr(p, "to_local") else p).numel() * 4
    return read, held


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_each_tp_rank_reads_only_its_shard(models):
    """Two tp ranks of each model (Llama: rows of q/k/v in rotary order, columns of o/down; GPT-2:
    transposed column slices of Conv1D weights and of the fused c_attn): each reads exactly the
    bytes it holds, half of everything tensor parallelism splits."""
    from _spawn import spawn

    from hetero.hf.config import read_hf_config

    specs = [read_hf_config(str(models[kind])).spec for kind in ("llama", "gpt2")]
    results = spawn(_tp_worker, 2, args=([(str(models[k]), s.to_dict()) for k, s in zip(("llama", "gpt2"), specs)],),
                    timeout=100)
    for m, spec in enumerate(specs):
        replicated = (spec.num_layers * spec.tp_replicated_per_layer() + spec.final_norm_params()
                      + spec.position_params())
        split = spec.total_params() - replicated   # one stage holds the whole model: one (tied) embedding
        for rank in results:
            read, held = rank[m]
            assert read == held                      # exactly the shard, no whole tensor on the way
            assert read == (split // 2 + replicated) * 4


# ---------------------------------------------------------------------------- training from an HF folder


def _write_yaml(path: Path, data: dict) -> str:
    import yaml

    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_launch_from_hf_folder_pp2_tp2_first_loss_equals_transformers(models, tmp_path, kind):
    from hetero.hf.config import read_hf_config
    from hetero.runtime.data import TokenSource

    spec = read_hf_config(str(models[kind])).spec
    data = tmp_path / "tokens.npy"   # one fixed sequence: every sample is a window of it
    np.save(data, np.random.default_rng(7).integers(0, VOCAB, spec.seq_length + 2).astype(np.int32))
    summary = tmp_path / "summary.json"
    cmd = [sys.executable, "-m", "hetero", "launch", "--cluster", _write_yaml(tmp_path / "c.yaml", CLUSTER),
           "--model", _write_yaml(tmp_path / "m.yaml", spec.to_dict()),
           "--plan", _write_yaml(tmp_path / "p.yaml", PP2_TP2), "--load", f"hf:{models[kind]}",
           "--data", str(data), "--steps", "1", "--summary", str(summary), "--timeout", "30", "--quiet",
           "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert not _leftover(tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    loss = json.loads(summary.read_text())["losses"][0]
    x, y = TokenSource(VOCAB, spec.seq_length, 0, str(data)).batch(0, PP2_TP2["global_batch_size"])
    with torch.no_grad():
        logits = _hf_model(models[kind])(x).logits
    expected = float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)))
    assert loss == pytest.approx(expected, rel=1e-4)


# ---------------------------------------------------------------------------- bad input


def _fails(capsys, *argv: str) -> str:
    assert _cli(*argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _nothing_written(out: Path) -> None:
    assert_no_leftover(files=[out])   # nor OUT.partial, the folder a conversion stages into


def test_a_folder_without_config_json(models, tmp_path, capsys):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    shutil.copy(models["gpt2"] / "model.safetensors", folder)
    err = _fails(capsys, "import-hf", str(folder), "-o", str(tmp_path / "out"))
    assert f"{folder / 'config.json'}: not found" in err and "fix:" in err
    _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("change, says", [({"model_type": "bert"}, "model_type 'bert' is not supported"),
                                          ({"attention_bias": True}, "attention_bias is true: biases on the output"),
                                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' rotary")])
def test_an_unsupported_model(models, tmp_path, capsys, change, says):
    folder = tmp_path / "changed"
    shutil.copytree(models["llama"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters", None) if "rope_scaling" in change else None
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    err = _fails(capsys, "import-hf", str(folder), "-o", str(tmp_path / "out"))
    assert str(folder / "config.json") in err and says in err and "llama, mistral" in err
    _nothing_written(tmp_path / "out")


def test_tensor_shapes_that_contradict_the_config(models, tmp_path, capsys):
    folder = tmp_path / "gpt2-wrong"
    shutil.copytree(models["gpt2"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "n_inner": 128}))
    err = _fails(capsys, "import-hf", str(folder), "-o", str(tmp_path / "out"))
    assert str(folder / "model.safetensors") in err and "c_fc" in err and "[64, 256]" in err and "[64, 128]" in err
    _nothing_written(tmp_path / "out")


def test_export_of_a_checkpoint_of_another_model(models, tmp_path, capsys):
    import yaml

    assert _cli("import-hf", str(models["llama"]), "-o", str(tmp_path / "llama")) == 0
    other = yaml.safe_load((tmp_path / "llama" / "model.yaml").read_text())
    model = _write_yaml(tmp_path / "other.yaml", {**other, "num_layers": 3})
    checkpoint = str(tmp_path / "llama" / "checkpoint")
    err = _fails(capsys, "export-hf", "--model", model, "--checkpoint", checkpoint, "-o", str(tmp_path / "out"))
    assert err.startswith(f"error: --checkpoint {checkpoint}: the checkpoint was written for another model")
    _nothing_written(tmp_path / "out")


def test_launch_load_hf_of_another_model(models, tmp_path, capsys):
    from hetero.hf.config import read_hf_config

    spec = read_hf_config(str(models["llama"])).spec.to_dict()
    err = _fails(capsys, "launch", "--cluster", _write_yaml(tmp_path / "c.yaml", CLUSTER),
                 "--model", _write_yaml(tmp_path / "m.yaml", {**spec, "ffn_hidden_size": 128}),
                 "--plan", _write_yaml(tmp_path / "p.yaml", PP2_TP2), "--load", f"hf:{models['llama']}", "--dry-run")
    assert "describes another model" in err and "ffn_hidden_size 96 there, 128 in the model file" in err


# ---------------------------------------------------------------------------- --tokenizer


def _tokenizer(path: Path, words: int) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(words - 1)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))
    return path


def test_tokenizer_caches_ids_beside_the_text(tmp_path):
    from tokenizers import Tokenizer

    from hetero.hf.tokens import cached_tokens
    from hetero.runtime.data import check_token_file

    tok = _tokenizer(tmp_path / "tokenizer.json", 200)
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(" ".join(f"w{(7 * i + j) % 250}" for j in range(9)) for i in range(40)) + "\n")
    first = cached_tokens(str(text), str(tmp_path), VOCAB)   # a folder holding tokenizer.json
    assert os.path.dirname(first) == str(tmp_path) and first.endswith(".bin")
    ids = check_token_file(first, VOCAB, 16)
    assert ids.tolist() == Tokenizer.from_file(str(tok)).encode(text.read_text(), add_special_tokens=False).ids
    stamp = os.stat(first).st_mtime_ns
    assert cached_tokens(str(text), str(tok), VOCAB) == first and os.stat(first).st_mtime_ns == stamp
    text.write_text(text.read_text() + "w1 w2\n")   # a changed text: a new cache
    assert cached_tokens(str(text), str(tok), VOCAB) != first


def test_tokenizer_vocabulary_larger_than_the_model(models, tmp_path, capsys):
    from hetero.hf.config import read_hf_config

    tok = _tokenizer(tmp_path / "tokenizer.json", VOCAB + 20)
    text = tmp_path / "corpus.txt"
    text.write_text("w1 w2 w3\n" * 50)
    spec = read_hf_config(str(models["llama"])).spec.to_dict()
    err = _fails(capsys, "launch", "--cluster", _write_yaml(tmp_path / "c.yaml", CLUSTER),
                 "--model", _write_yaml(tmp_path / "m.yaml", spec),
                 "--plan", _write_yaml(tmp_path / "p.yaml", PP2_TP2), "--data", str(text), "--tokenizer", str(tok),
                 "--dry-run")
    assert f"--tokenizer {tok}: its vocabulary has {VOCAB + 20} tokens" in err and "fix:" in err
    assert sorted(os.listdir(tmp_path)) == ["c.yaml", "corpus.txt", "m.yaml", "p.yaml", "tokenizer.json"]

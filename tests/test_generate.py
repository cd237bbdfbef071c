"""Generation on the runtime's own model (hetero.rl.generate, ``hetero generate``): greedy decoding of
an imported Hugging Face Llama (grouped-query attention, rotary positions) equals transformers'
``generate`` token for token; the cached decode computes what recomputing the whole sequence does
(gpt and llama, a prefill in two chunks too); a sample's tokens depend on (seed, step, prompt,
sample) and not on the batch it was generated in; end token and stop string; the command's --json
and its errors."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("safetensors")

from helpers import random_state_checkpoint, tiny_model, write_yaml

VOCAB = 300
MAX_NEW = 24


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: a second thread only waits for a core the other tests share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cli(*argv: str) -> int:
    from hetero.cli import main

    return main(list(argv))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random Hugging Face Llama (4 heads, 2 kv heads, untied head, rotary base 50000) saved with
    save_pretrained, and what hetero import-hf made of it."""
    transformers = pytest.importorskip("transformers")
    from hetero.hf.convert import import_hf

    root = tmp_path_factory.mktemp("gen")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, rope_theta=50000.0, rms_norm_eps=1e-6,
                                   initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import_hf(str(root / "hf"), str(root / "imported"))
    return root


def _whole(spec, load=None, seed=0):
    from hetero.rl.load import load_whole_model

    return load_whole_model(spec, load, seed=seed)


def _spec(d):
    import hetero

    return hetero.load_model(d)


# ---------------------------------------------------------------------------- greedy equals references


def test_greedy_of_an_imported_llama_equals_transformers_generate(llama):
    """Prompts of 3, 7 and 12 tokens, 24 new ones each, the end token (2) as transformers has it."""
    transformers = pytest.importorskip("transformers")
    from hetero.rl.generate import generate

    spec = _spec(str(llama / "imported" / "model.yaml"))
    assert spec.num_kv_heads < spec.num_attention_heads and spec.architecture == "llama"
    model = _whole(spec, str(llama / "imported" / "checkpoint"))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 7, 12)]
    ours = generate(model, prompts, max_new_tokens=MAX_NEW, eos_id=2)
    hf = transformers.LlamaForCausalLM.from_pretrained(llama / "hf").eval()
    for prompt, c in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                              eos_token_id=2, pad_token_id=0)
        assert c.tokens == ref[0, len(prompt):].tolist()
        assert c.prompt_tokens == prompt and c.finish_reason in ("eos", "length") and c.text is None
    assert len({tuple(c.tokens) for c in ours}) == 3   # three different continuations
    # the folder itself (--load hf:DIR) gives the same
    direct = generate(_whole(spec, f"hf:{llama / 'hf'}"), prompts, max_new_tokens=MAX_NEW, eos_id=2)
    assert [c.tokens for c in direct] == [c.tokens for c in ours]


def _full_recompute(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_cached_decode_equals_recomputing_the_sequence(arch):
    """Greedy tokens equal the argmax of the model's own full forward at every step; the logits of a
    prefill in two chunks (the second attends to the cached first) equal the full forward's."""
    from hetero.rl.generate import generate, last_logits
    from hetero.rl.kv_cache import KVCache

    spec = _spec(tiny_model(arch, vocab_size=VOCAB, seq_length=40))
    model = _whole(spec, seed=3)
    prompts = [[5, 17, 250, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    for prompt, c in zip(generate(model, prompts, max_new_tokens=16), prompts):
        assert prompt.tokens == _full_recompute(model, c, 16)
    tokens = torch.tensor([list(range(10, 30)), list(range(40, 60))])
    cache = KVCache(model.layers.keys(), 20)
    with torch.no_grad():
        last_logits(model, tokens[:, :7], cache)
        chunked = last_logits(model, tokens[:, 7:], cache)
        full = model(tokens)[:, -1]
    assert cache.length == 20
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)


def test_whole_model_takes_the_weights_of_a_saved_checkpoint_and_leaves_its_optimizer_state(tmp_path):
    """A checkpoint as hetero launch --save writes it (AdamW moments beside the weights): every
    parameter equals the stored tensor; the moments are not read."""
    import torch.distributed.checkpoint as dcp

    from hetero.runtime.checkpoint import SafeReader

    model = tiny_model("llama", vocab_size=VOCAB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        random_state_checkpoint(str(tmp_path / "ckpt"), model)
        whole = _whole(_spec(model), str(tmp_path / "ckpt"))
        stored = {f"model/{n}": torch.empty(p.shape) for n, p in whole.named_parameters()}
        dcp.load(stored, storage_reader=SafeReader(str(tmp_path / "ckpt")), no_dist=True)
    assert any(k.startswith("optim/") for k in SafeReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata)
    for name, p in whole.named_parameters():
        assert torch.equal(p, stored[f"model/{name}"]), name


# ---------------------------------------------------------------------------- sampling


def test_a_sample_depends_on_seed_step_prompt_and_index_not_on_its_batch():
    """Three prompts (two of one length, so they share batches) x 3 samples at temperature 1 in
    batches of 4 rows: each sample generated alone, or with the prompts in reverse order, has the
    same tokens bit for bit; another step or seed gives other tokens."""
    from hetero.rl.generate import generate

    model = _whole(_spec(tiny_model("llama", vocab_size=VOCAB, seq_length=40)), seed=1)
    prompts = [[1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1], [7, 7, 7, 7, 7, 7, 7, 7, 7]]
    kw = dict(max_new_tokens=12, temperature=1.0, seed=5, step=2, batch_rows=4)
    together = generate(model, prompts, samples=3, **kw)
    assert [(c.prompt_index, c.sample_index) for c in together] == [(i, s) for i in range(3) for s in range(3)]
    by_key = {(c.prompt_index, c.sample_index): c.tokens for c in together}
    assert len(set(map(tuple, by_key.values()))) == 9   # sampled: every sample differs
    for (i, s), tokens in by_key.items():
        alone = generate(model, [prompts[i]], prompt_indices=[i], first_sample=s, **kw)
        assert alone[0].tokens == tokens and (alone[0].prompt_index, alone[0].sample_index) == (i, s)
    reverse = generate(model, prompts[::-1], prompt_indices=[2, 1, 0], samples=3, **kw)
    assert {(c.prompt_index, c.sample_index): c.tokens for c in reverse} == by_key
    for other in ({"step": 3}, {"seed": 6}):
        moved = generate(model, prompts, samples=3, **{**kw, **other})
        assert all(c.tokens != by_key[(c.prompt_index, c.sample_index)] for c in moved)


class _TwoLetters:
    """A tokenizer whose every id decodes to two letters, so a stop string can end inside a token."""

    eos_ids = ()

    def decode(self, ids):
        return "".join(chr(97 + i % 26) + chr(97 + (i // 26) % 26) for i in ids)


def test_end_token_and_stop_string_end_a_completion():
    from hetero.rl.generate import generate

    model = _whole(_spec(tiny_model("gpt", vocab_size=VOCAB, seq_length=40)), seed=2)
    tok = _TwoLetters()
    full = generate(model, [[3, 1, 4, 1, 5]], max_new_tokens=16, tokenizer=tok)[0]
    assert full.finish_reason == "length" and full.text == tok.decode(full.tokens) and len(full.tokens) == 16
    stop = full.text[5:8]   # ends inside the fourth token
    cut = generate(model, [[3, 1, 4, 1, 5]], max_new_tokens=16, tokenizer=tok, stop=stop)[0]
    end = full.text.index(stop) + len(stop)
    assert cut.finish_reason == "stop" and cut.text == full.text[:end]
    assert cut.tokens == full.tokens[:(end + 1) // 2]   # through the token that completed the stop string
    eos = full.tokens[6]
    ended = generate(model, [[3, 1, 4, 1, 5]], max_new_tokens=16, tokenizer=tok, eos_id=[999, eos])[0]
    first = full.tokens.index(eos)
    assert ended.finish_reason == "eos" and ended.tokens == full.tokens[:first + 1]
    assert ended.text == tok.decode(full.tokens[:first])   # the end token has no text
    with pytest.raises(ValueError, match="stop string needs a tokenizer"):
        generate(model, [[1]], max_new_tokens=2, stop="x")


# ---------------------------------------------------------------------------- hetero generate


def test_generate_command_prints_json_of_the_api_completions(llama, tmp_path, capsys):
    from hetero.rl.generate import generate
    from hetero.tokenizer import load_text_tokenizer

    imported = llama / "imported"
    args = ("generate", "--model", str(imported / "model.yaml"), "--load", str(imported / "checkpoint"),
            "--max-new-tokens", "6", "--json")
    assert _cli(*args, "--prompt", "Héllo") == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["completions"] and len(out["completions"]) == 1
    c = out["completions"][0]
    assert sorted(c) == ["completion", "prompt", "tokens"] and c["prompt"] == "Héllo"
    spec = _spec(str(imported / "model.yaml"))
    tok = load_text_tokenizer("bytes", spec.vocab_size)
    api = generate(_whole(spec, str(imported / "checkpoint")), [list("Héllo".encode())], max_new_tokens=6,
                   tokenizer=tok, batch_rows=1)[0]   # the command's rows for one prompt
    assert c["tokens"] == api.tokens and c["completion"] == api.text == tok.decode(api.tokens)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ab", "answer": 3}\n\n{"prompt": "xyz"}\n')
    runs = []
    for _ in range(2):
        assert _cli(*args, "--prompts", str(prompts), "--temperature", "0.8", "--seed", "4") == 0
        runs.append(json.loads(capsys.readouterr().out)["completions"])
    assert runs[0] == runs[1] and [c["prompt"] for c in runs[0]] == ["ab", "xyz"]


def test_generate_command_errors_are_one_line(llama, tmp_path, capsys):
    imported = llama / "imported"
    model, ckpt = str(imported / "model.yaml"), str(imported / "checkpoint")
    small = write_yaml(tmp_path, "small.yaml", tiny_model("llama", vocab_size=200))
    other = write_yaml(tmp_path, "other.yaml", tiny_model("llama", vocab_size=VOCAB, hidden_size=32))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    cases = [
        (("--model", small, "--load", ckpt, "--prompt", "a"), "vocab_size is 200"),
        (("--model", model, "--load", str(tmp_path / "nowhere"), "--prompt", "a"), "not a directory"),
        (("--model", other, "--load", ckpt, "--prompt", "a"), "written for another model"),
        (("--model", other, "--load", f"hf:{llama / 'hf'}", "--prompt", "a"), "describes another model"),
        (("--model", model, "--load", ckpt, "--prompts", str(bad)), "line 2"),
        (("--model", model, "--load", ckpt, "--prompt", "x" * 60, "--max-new-tokens", "8"), "seq_length 64"),
    ]
    for argv, expected in cases:
        assert _cli("generate", *argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err


def test_a_hugging_face_tokenizer_brings_its_end_token(tmp_path):
    """The end token comes from generation_config.json / config.json (a list kept whole), else from
    tokenizer_config.json's eos_token; text round-trips; bytes needs a vocabulary of 256."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hetero.errors import HeteroError
    from hetero.tokenizer import load_text_tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<eot>": 3, "hello": 4, "world": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<eot>"])
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    t = load_text_tokenizer(str(folder), 16)
    assert t.eos_ids == (2,) and t.encode("hello world") == [4, 5] and t.decode([4, 2]) == "hello"
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [3, 2]}))
    assert load_text_tokenizer(str(folder / "tokenizer.json"), 16).eos_ids == (3, 2)
    with pytest.raises(HeteroError, match="more than the model's vocab_size 4"):
        load_text_tokenizer(str(folder), 4)
    assert load_text_tokenizer("bytes", 256).decode(list("é".encode()) + [300]) == "é"
    with pytest.raises(HeteroError, match="vocab_size is 255"):
        load_text_tokenizer("bytes", 255)

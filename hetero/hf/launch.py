"""What ``hetero launch`` does for Hugging Face inputs before any worker starts: checks a
``--load hf:DIR`` folder against the model file (config and every tensor's shape, from the file
headers only), and turns a text ``--data`` into token ids with ``--tokenizer``."""
from __future__ import annotations

import os

from hetero.errors import HeteroError
from hetero.hf import HF_PREFIX, hf_dir_of


def absolute_load(load: str | None) -> str | None:
    """``--load`` made absolute (``hf:DIR`` keeps its prefix)."""
    if not load:
        return None
    hf_dir = hf_dir_of(load)
    return HF_PREFIX + os.path.abspath(hf_dir) if hf_dir is not None else os.path.abspath(load)


def prepare_launch(args, model, options, print_fn=None) -> None:
    """Check ``--load hf:DIR`` and tokenize ``--data`` with ``--tokenizer``, updating ``options``."""
    hf_dir = hf_dir_of(options.load)
    if hf_dir is not None:
        from hetero.hf.config import check_matches, read_hf_config
        from hetero.hf.weights import SafetensorsFolder, check_tensors, gpt2_prefix, sources

        if args.engine != "native":
            raise HeteroError(f"--load {args.load} with --engine {args.engine}: Hugging Face weights load into the "
                              f"native engine (fix: use --engine native, or hetero import-hf first)")
        flag = f"--load {args.load}"
        hf = read_hf_config(hf_dir, seq_length=model.seq_length)
        check_matches(hf, model, flag)
        folder = SafetensorsFolder(hf_dir)
        check_tensors(folder, sources(model, hf.family, gpt2_prefix(folder) if hf.family == "gpt2" else ""),
                      hf.config_file, hf.config["model_type"])
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer:
        if not options.data:
            raise HeteroError(f"--tokenizer {tokenizer}: no --data to tokenize (fix: give a text file with --data)")
        from hetero.runtime.prompt_data import is_prompt_file
        from hetero.tokenizer import BYTES

        if options.data.endswith((".npy", ".bin", ".i32")):
            raise HeteroError(f"--tokenizer {tokenizer} with --data {args.data}: that file holds token ids already "
                              f"(fix: give the text file, or leave --tokenizer out)")
        if tokenizer == BYTES:   # UTF-8 bytes as ids: what text and prompt/completion lines use by default
            return
        if is_prompt_file(options.data):   # the workers tokenize the prompts and completions themselves
            from hetero.hf.tokens import tokenizer_file

            options.tokenizer = os.path.abspath(tokenizer_file(tokenizer))
            return
        from hetero.hf.tokens import cached_tokens

        options.data = cached_tokens(options.data, tokenizer, model.vocab_size, print_fn)

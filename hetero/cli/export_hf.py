"""``hetero export-hf``: a checkpoint -> a Hugging Face model folder transformers loads."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export-hf", help="write a checkpoint as a Hugging Face model folder (config.json + safetensors)",
        description="Write config.json and the weights as safetensors shards (with their index) that "
                    "transformers' from_pretrained loads, in the model file's dtype. --base: a folder whose "
                    "config.json seeds the written one (token ids, model_type, positions) and whose tokenizer "
                    "files are copied, e.g. the hf folder import-hf wrote. OUT appears only when complete.")
    p.add_argument("--model", required=True, help="model file (YAML) of the checkpoint")
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint hetero launch --save or import-hf wrote")
    p.add_argument("-o", "--output", required=True, metavar="HF_DIR", help="a new directory")
    p.add_argument("--base", metavar="DIR", help="config and tokenizer files to carry over (import-hf's OUT/hf)")
    p.add_argument("--max-shard-size", default="2GB", help="largest safetensors file (default 2GB)")
    from ._common import folder_outputs

    p.set_defaults(func=run,  # check_outputs_apart
                   inputs={"--model": "model", "--checkpoint": "checkpoint", "--base": "base"},
                   outputs=folder_outputs("-o", "output", previous=False))


def run(args) -> int:
    import os

    from hetero.errors import HeteroError
    from hetero.hf.convert import export_hf, parse_size
    from hetero.specs.model import load_model
    from hetero.specs.units import plural

    from ._common import console

    model = load_model(args.model)
    if not os.path.isdir(args.checkpoint):
        raise HeteroError(f"--checkpoint {args.checkpoint}: not a directory (fix: give the directory hetero launch "
                          f"--save or hetero import-hf wrote)")
    files = export_hf(model, args.checkpoint, args.output, parse_size(args.max_shard_size), args.base)
    shards = sum(f.endswith(".safetensors") for f in files)
    console().print(f"{args.output}: config.json and {plural(shards, 'safetensors file')} "
                    f"({model.total_params() / 1e6:.1f} M parameters, {model.dtype})")
    return 0

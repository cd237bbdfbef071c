"""``hetero import-hf``: a Hugging Face model folder -> a model file and a checkpoint ``launch --load`` takes."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "import-hf", help="convert a Hugging Face model folder into a model file and a hetero checkpoint",
        description="Read config.json and the safetensors weights (one file or a sharded index) of a Llama, "
                    "Mistral, Qwen2 (with its q/k/v biases) or GPT-2 model and write OUT/model.yaml, OUT/checkpoint "
                    "(plan-independent: hetero launch --load OUT/checkpoint with any plan) and OUT/hf (the "
                    "folder's config and tokenizer files, for export-hf --base). Tensors are streamed one at a "
                    "time; OUT appears only when complete.")
    p.add_argument("hf_dir", metavar="HF_DIR", help="the folder save_pretrained wrote")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="a new directory")
    p.add_argument("--name", help="the model's name in model.yaml (default: the folder's name)")
    p.add_argument("--seq-length", type=int, metavar="N",
                   help="training sequence length (default: the model's positions, at most 4096 for rotary "
                        "models; GPT-2 takes exactly n_positions)")
    from ._common import folder_outputs

    p.set_defaults(func=run, inputs={"HF_DIR": "hf_dir"},   # check_outputs_apart
                   outputs=folder_outputs("-o", "output", previous=False))


def run(args) -> int:
    import os

    from hetero.hf.convert import import_hf

    from ._common import console

    hf = import_hf(args.hf_dir, args.output, args.name, args.seq_length)
    s = hf.spec
    console().print(f"{hf.config['model_type']} -> {s.architecture}: {s.num_layers} layers, hidden {s.hidden_size}, "
                    f"{s.num_attention_heads} heads ({s.num_kv_heads} kv), ffn {s.ffn_hidden_size}, vocab "
                    f"{s.vocab_size}, seq {s.seq_length}, {s.dtype}, {s.total_params() / 1e6:.1f} M parameters\n"
                    f"model file: {os.path.join(args.output, 'model.yaml')}\n"
                    f"checkpoint: {os.path.join(args.output, 'checkpoint')}")
    return 0

"""``hetero import-hf`` and ``hetero export-hf``: a Hugging Face model folder <-> a model file and a
plan-independent checkpoint (:mod:`hetero.runtime.checkpoint`).

Both stream: import writes the checkpoint through torch.distributed.checkpoint with every tensor read
from the safetensors files only when the writer asks for it, export assembles one safetensors shard
at a time from single-tensor loads. Neither holds more than one tensor (export: one shard) at once.
Each writes into ``OUT.partial`` and moves it into place when complete, so a failure leaves nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings

import torch

from hetero.errors import HeteroError
from hetero.hf import require
from hetero.hf.config import HFModel, hf_config, read_hf_config
from hetero.hf.weights import SafetensorsFolder, Source, check_tensors, gpt2_prefix, read_param, sources
from hetero.specs.io import staging_path
from hetero.specs.model import ModelSpec

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
"""Files of the source folder kept in ``OUT/hf`` by import-hf (export-hf --base takes them back)."""
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _fresh_output(out: str, flag: str) -> str:
    """The staging directory for ``out``; ``out`` must not exist or be an empty directory."""
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        raise HeteroError(f"{flag} {out}: already exists and is not an empty directory (fix: give a new "
                          f"directory; nothing is overwritten)")
    staging = staging_path(out)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    return staging


def _finish(staging: str, out: str) -> None:
    if os.path.isdir(out):
        os.rmdir(out)   # empty (checked before any work)
    os.replace(staging, out)


def _lazy_dcp_save(state: dict, loaders: dict, path: str) -> None:
    """``dcp.save`` of ``state`` where ``loaders[key]()`` gives the tensor of each key whose entry is a
    meta-device placeholder: the writer resolves them one by one as it writes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class LazyPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            fqn = write_item.index.fqn
            return loaders[fqn]() if fqn in loaders else super().resolve_data(write_item)

    with warnings.catch_warnings():   # "no process group: saving as a single process" is the intent
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, planner=LazyPlanner(), no_dist=True)


def import_hf(hf_dir: str, out: str, name: str | None = None, seq_length: int | None = None) -> HFModel:
    """Write ``out/model.yaml``, ``out/checkpoint`` (what ``hetero launch --load`` takes) and ``out/hf``
    (the folder's config and tokenizer files) from the Hugging Face model folder ``hf_dir``."""
    from hetero.runtime.model import stage_param_shapes

    hf = read_hf_config(hf_dir, name, seq_length)
    folder = SafetensorsFolder(hf_dir)
    srcs = sources(hf.spec, hf.family, gpt2_prefix(folder) if hf.family == "gpt2" else "")
    check_tensors(folder, srcs, hf.config_file, hf.config["model_type"])
    staging = _fresh_output(out, "-o")
    try:
        hf.spec.save(os.path.join(staging, "model.yaml"))
        state: dict[str, torch.Tensor] = {"meta/step": torch.tensor(0, dtype=torch.int64)}
        loaders = {}
        shapes = stage_param_shapes(hf.spec, (0, hf.spec.num_layers), True, True)
        for rt_name, src in srcs.items():
            key, shape = f"model/{rt_name}", shapes[rt_name]
            state[key] = torch.empty(shape, dtype=torch.float32, device="meta")
            loaders[key] = (lambda s=src, r=[(0, n) for n in shape]: read_param(folder, s, r).float())
        _lazy_dcp_save(state, loaders, os.path.join(staging, "checkpoint"))
        os.makedirs(os.path.join(staging, "hf"))
        for f in COPIED:
            if os.path.isfile(os.path.join(hf_dir, f)):
                shutil.copyfile(os.path.join(hf_dir, f), os.path.join(staging, "hf", f))
        _finish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return hf


def parse_size(text: str) -> int:
    """``2GB``, ``500MB``, ``64KiB`` or a byte count -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    number = t.rstrip("KMGIB")
    try:
        value = int(float(number) * units[t[len(number):]])
    except (ValueError, KeyError):
        value = 0
    if value < 1:
        raise HeteroError(f"--max-shard-size {text!r}: not a size (fix: e.g. 2GB, 500MB)")
    return value


def export_hf(spec: ModelSpec, checkpoint: str, out: str, max_shard_bytes: int = 2 * 10**9,
              base: str | None = None) -> list[str]:
    """Write the Hugging Face folder ``out`` (config.json, safetensors shards and their index) of the
    model ``spec`` with the weights of ``checkpoint``; ``base``: a folder whose config.json seeds the
    written one and whose tokenizer files are copied (import-hf's ``OUT/hf``). Returns the files written."""
    from hetero.runtime.checkpoint import check_same_model, SafeReader
    from hetero.runtime.model import stage_param_shapes

    save_file = require("safetensors.torch", "export-hf").save_file
    base_config = _read_base(base)
    shapes = stage_param_shapes(spec, (0, spec.num_layers), True, True)
    try:
        saved = SafeReader(checkpoint).read_metadata().state_dict_metadata
        check_same_model(checkpoint, saved, shapes, spec.num_layers)
    except HeteroError as e:   # the checkpoint module speaks of --load; here the flag is --checkpoint
        raise HeteroError(str(e).replace(f"--load {checkpoint}", f"--checkpoint {checkpoint}", 1)) from None
    family = "llama" if spec.architecture == "llama" else "gpt2"
    by_key: dict[str, list[tuple[str, Source]]] = {}
    for rt_name, src in sources(spec, family, "transformer." if family == "gpt2" else "").items():
        by_key.setdefault(src.key, []).append((rt_name, src))
    dtype = TORCH_DTYPES[spec.dtype]
    shards: list[list[str]] = [[]]
    filled = 0
    item = torch.empty((), dtype=dtype).element_size()
    for key, parts in by_key.items():
        size = item * int(torch.Size(parts[0][1].hf_shape).numel())
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(key)
        filled += size
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    staging = _fresh_output(out, "-o")
    try:
        weight_map, total = {}, 0
        for file, keys in zip(names, shards):
            tensors = {k: _assemble(checkpoint, by_key[k], shapes).to(dtype) for k in keys}
            save_file(tensors, os.path.join(staging, file), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({k: file for k in keys})
            del tensors
        if len(names) > 1:
            _write_json(os.path.join(staging, "model.safetensors.index.json"),
                        {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(os.path.join(staging, "config.json"), hf_config(spec, base_config))
        for f in COPIED[1:] if base else ():
            if os.path.isfile(os.path.join(base, f)):
                shutil.copyfile(os.path.join(base, f), os.path.join(staging, f))
        written = sorted(os.listdir(staging))
        _finish(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return written


def _read_base(base: str | None) -> dict | None:
    if base is None:
        return None
    path = os.path.join(base, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise HeteroError(f"--base {path}: cannot read it ({e}) (fix: give the hf folder hetero import-hf wrote, "
                          f"or leave --base out)") from None
    if not isinstance(cfg, dict):
        raise HeteroError(f"--base {path}: not a JSON object (fix: give the hf folder hetero import-hf wrote)")
    return cfg


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _load_one(checkpoint: str, name: str, shape: tuple) -> torch.Tensor:
    """One full tensor ``model/<name>`` of the checkpoint."""
    import torch.distributed.checkpoint as dcp

    from hetero.runtime.checkpoint import SafeReader

    state = {f"model/{name}": torch.empty(shape)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=SafeReader(checkpoint), no_dist=True)
    return state[f"model/{name}"]


def _assemble(checkpoint: str, parts: list[tuple[str, Source]], shapes: dict) -> torch.Tensor:
    """One Hugging Face tensor from the runtime parameters stored in it (q, k and v fill GPT-2's
    fused c_attn; q and k rows go back to the halves order; Conv1D weights are transposed back)."""
    out = torch.empty(parts[0][1].hf_shape)
    for name, src in parts:
        full = _load_one(checkpoint, name, shapes[name])
        index = src.hf_index([(0, n) for n in full.shape])
        if len(index) == 1:
            out[index[0]] = full
        else:
            out[index[0][:, None], index[1][None, :]] = full.t() if src.transpose else full
    return out

"""`shardlm checkpoint inspect|convert` and `shardlm convert --from-hf/--to-hf`."""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
from pathlib import Path

from shardlm.checkpoint.hf import FAMILIES, MODEL_TYPES


def add_parser(subparsers) -> None:
    checkpoint = subparsers.add_parser("checkpoint", help="inspect or consolidate checkpoints")
    actions = checkpoint.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    inspect = actions.add_parser("inspect", help="print what a checkpoint holds and verify its files")
    inspect.add_argument("path", help="checkpoint step directory, the folder holding `latest`, or a .safetensors")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.set_defaults(func=run_inspect)
    convert = actions.add_parser("convert", help="write a consolidated single-file (TP=1) checkpoint")
    convert.add_argument("path", help="checkpoint step directory or the folder holding `latest`")
    convert.add_argument("--output", required=True, help="output .safetensors file")
    convert.set_defaults(func=run_consolidate)

    hf = subparsers.add_parser("convert", help="convert weights to or from Hugging Face transformers: "
                                                   f"{FAMILIES}")
    direction = hf.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR",
                           help="a Hugging Face model directory (config.json + safetensors) of one of these "
                                f"model types: {', '.join(MODEL_TYPES)}")
    direction.add_argument("--to-hf", metavar="DIR",
                           help="write a HF directory here in the model's own transformers class "
                                "(GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM, DeepseekV3ForCausalLM, ...: "
                                "the class of the directory it was converted from)")
    direction.add_argument("--to-peft", metavar="DIR",
                           help="write a LoRA run's adapters here as a peft adapter directory (adapter_model."
                                "safetensors, adapter_config.json); with --merge, the base with the adapters folded "
                                "in as a plain HF directory")
    hf.add_argument("--checkpoint", help="with --to-hf / --to-peft: the shardlm checkpoint (directory or consolidated "
                                         "file); --to-hf of a LoRA run's checkpoint merges its adapters into the base")
    hf.add_argument("--merge", action="store_true", help="with --to-peft: fold the adapters into the base")
    hf.add_argument("--output", help="with --from-hf: the consolidated shardlm checkpoint file to write")
    hf.set_defaults(func=run_hf)


@contextlib.contextmanager
def progress(what: str):
    """On a terminal, a line on stderr while `what` runs, with the time it has taken so far, refreshed every second
    (the converters read and write whole models and report no count of their own); nothing when stderr is not a
    terminal (tqdm's `disable=None`)."""
    from tqdm import tqdm

    bar = tqdm(desc=what, bar_format="{desc}: {elapsed} elapsed", leave=False, disable=None)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    if not bar.disable:
        ticker.start()
    try:
        yield
    finally:
        stop.set()
        if ticker.is_alive():
            ticker.join()
        bar.close()


def run_inspect(args: argparse.Namespace) -> int:
    from shardlm.checkpoint import files
    from shardlm.checkpoint.state import consolidated_config

    path = Path(args.path)
    if path.is_file():
        from safetensors import safe_open

        config = consolidated_config(path)
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        info = {"kind": "consolidated", "path": str(path), "model": vars(config.model), "tensors": tensors}
    else:
        checkpoint = files.resolve(path)
        meta = files.read_meta(checkpoint)
        files.verify(checkpoint, meta, list(meta["files"]))
        keys = ("step", "consumed_samples", "skipped_steps", "tensor_parallel", "data_parallel", "world_size",
                "padded_vocab_size", "scaler")
        parallel = meta["config"]["parallel"]
        pipeline = {"pipeline_parallel": meta.get("pipeline_parallel", 1),
                    "expert_parallel": meta.get("expert_parallel", 1),
                    "pipeline_schedule": parallel.get("pipeline_schedule", "1f1b"),
                    "virtual_stages": parallel.get("virtual_stages", 1)}
        info = {"kind": "sharded", "path": str(checkpoint), **{k: meta[k] for k in keys}, **pipeline,
                "model": meta["config"]["model"], "files_verified": len(meta["files"]),
                "bytes": sum(f["bytes"] for f in meta["files"].values()),
                "tensors": {n: t["shape"] for n, t in meta["tensors"].items()}}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['kind']} checkpoint {info['path']}")
    for key, value in info.items():
        if key not in ("kind", "path", "tensors", "model"):
            print(f"  {key}: {value}")
    m = info["model"]
    print(f"  model: {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_heads']} heads, "
          f"sequence {m['seq_length']}, vocabulary {m['vocab_size']}")
    if m.get("attention") == "mla":
        print(f"  attention: multi-head latent (q_lora_rank {m['q_lora_rank']}, kv_lora_rank {m['kv_lora_rank']}, "
              f"q/k heads {m['qk_nope_head_dim']} + {m['qk_rope_head_dim']} rotary, v heads {m['v_head_dim']})")
    if m.get("attention_sinks") or m.get("sliding_window"):
        types = m.get("layer_types") or ["sliding_attention"] * m["num_layers"]
        sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"] if m.get("sliding_window") else []
        print(f"  attention: {'a sink logit per head, ' if m.get('attention_sinks') else ''}"
              f"sliding window {m.get('sliding_window', 0)} on layers {sliding}")
    if m.get("moe_num_experts"):
        first, every = m.get("moe_first_dense_layers", 0), m.get("moe_layer_interval", 1)
        moe_layers = [i for i in range(first, m["num_layers"]) if (i - first) % every == 0]
        print(f"  experts: {m['moe_num_experts']} per MoE layer (top-{m['moe_top_k']}, {m['moe_score']} router, "
              f"{m.get('moe_shared_experts', 0)} shared) on layers {moe_layers}; stored one tensor per expert "
              "under its global index")
    print(f"  tensors ({len(info['tensors'])}, shapes per TP shard for sharded checkpoints):")
    for name, shape in info["tensors"].items():
        print(f"    {name}: {shape}")
    return 0


def run_consolidate(args: argparse.Namespace) -> int:
    from shardlm.checkpoint import consolidate

    with progress(f"consolidating {args.path}"):
        out = consolidate(args.path, args.output)
    print(f"wrote {out}")
    return 0


def is_lora_checkpoint(path: str) -> bool:
    """Whether `path` is a sharded checkpoint of a LoRA run (its adapters only, `compatibility.py`)."""
    from shardlm.checkpoint import files

    return not Path(path).is_file() and bool(files.read_meta(files.resolve(path)).get("lora"))


def run_hf(args: argparse.Namespace) -> int:
    from shardlm.checkpoint.hf import from_hf, to_hf
    from shardlm.errors import UserError

    if args.merge and not args.to_peft:
        raise UserError("--merge goes with --to-peft (a LoRA run's checkpoint)")
    if args.from_hf:
        if not args.output:
            raise UserError("--from-hf needs --output FILE.safetensors (the shardlm checkpoint to write)")
        with progress(f"converting {args.from_hf}"):
            out = from_hf(args.from_hf, args.output)
        print(f"wrote {out}")
        return 0
    if not args.checkpoint:
        raise UserError(f"--to-{'hf' if args.to_hf else 'peft'} needs --checkpoint PATH (a shardlm checkpoint)")
    if args.to_peft and not args.merge:
        from shardlm.checkpoint.peft import write_peft

        with progress(f"writing {args.to_peft}"):
            out = write_peft(args.checkpoint, args.to_peft)
        settings = json.loads((out / "adapter_config.json").read_text())
        targets = [*settings["target_modules"], *(["experts"] if settings.get("target_parameters") else [])]
        print(f"wrote {out} (peft LoRA adapter, r={settings['r']}, targets {', '.join(targets)})")
        return 0
    lora = args.merge or is_lora_checkpoint(args.checkpoint)
    with progress(f"writing {args.to_peft or args.to_hf}"):
        if lora:
            from shardlm.checkpoint.peft import write_merged

            out = write_merged(args.checkpoint, args.to_peft or args.to_hf)
        else:
            out = to_hf(args.checkpoint, args.to_hf)
    kind = json.loads((out / "config.json").read_text()).get("architectures", ["?"])[0]
    note = "; experts unquantized (not MXFP4)" if kind == "GptOssForCausalLM" else ""
    merged = "; LoRA adapters merged into the base" if lora else ""
    print(f"wrote {out} ({kind}, fp32 safetensors{note}{merged})")
    return 0

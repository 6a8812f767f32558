"""LoRA fine-tuning throughput on 1 and 2 GPUs: a Llama-3-8B-shaped model (random weights, bf16), LoRA r16 on all
seven projections, ``--tokens`` tokens per GPU per step, under DDP (or FSDP2's ``fully_shard``): unpatched,
``fuselm.patch`` and (when liger-kernel imports) Liger-Kernel.

    torchrun --nproc-per-node 1 benchmarks/multi_gpu_bench.py --merge-into benchmarks/results/multi-gpu-h200x2.json
    torchrun --nproc-per-node 2 benchmarks/multi_gpu_bench.py --merge-into benchmarks/results/multi-gpu-h200x2.json

Per implementation: ``--warmup`` steps (compilation, autotuning, NCCL set-up), then ``--steps`` timed steps
(forward, backward, AdamW step), the host synchronised with every GPU (``torch.cuda.synchronize`` and a barrier)
before and after. Throughput = world size x tokens per GPU x steps / elapsed seconds; peak memory = the largest
``max_memory_allocated`` over the ranks. The merged JSON keeps each world size's figures and, once both are there,
the ratios the issue asks for (fuselm 2-GPU / 1-GPU, fuselm / unpatched on 2 GPUs). ``--smoke``: a tiny model on
CPU (gloo) to check the script.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import fuselm

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(args, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, num_hidden_layers=args.layers)
    if args.smoke:
        shape = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=2)
    config = LlamaConfig(**shape, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    with device:
        return LlamaForCausalLM._from_config(config, dtype=torch.float32 if args.smoke else torch.bfloat16)


def wrapped(model, args, device: torch.device):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=PROJECTIONS))
    model.train()
    if args.parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.get_base_model().model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def measure(impl: str, args, device: torch.device, world: int) -> dict:
    model = build(args, device)
    if impl == "fuselm":
        fuselm.patch(model)
    elif impl == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    model = wrapped(model, args, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own tokens
    ids = torch.randint(0, 256 if args.smoke else 128256, (1, args.tokens), generator=generator).to(device)

    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronise(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronise(device)
    elapsed = time.perf_counter() - start
    peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan"))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"tok_s": world * args.tokens * args.steps / elapsed, "step_ms": 1e3 * elapsed / args.steps,
            "peak_gib_per_gpu": peak.item()}


def merge(path: Path, world: int, args, results: dict) -> dict:
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged[f"{world}_gpu"] = {"results": results, "date": datetime.datetime.now(datetime.UTC).isoformat(),
                              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                              "parallel": args.parallel, "tokens_per_gpu": args.tokens, "steps": args.steps,
                              "layers": args.layers, "torch": torch.__version__}
    one, two = (merged.get(key, {}).get("results", {}) for key in ("1_gpu", "2_gpu"))
    ratios = {}
    if "fuselm" in one and "fuselm" in two:
        ratios["fuselm_2gpu_over_1gpu"] = two["fuselm"]["tok_s"] / one["fuselm"]["tok_s"]  # target >= 1.9
    if "fuselm" in two and "unpatched" in two:
        ratios["fuselm_over_unpatched_2gpu"] = two["fuselm"]["tok_s"] / two["unpatched"]["tok_s"]  # target >= 1.15
    merged["ratios"] = ratios
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=2) + "\n")
    return merged


def liger_available() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default="unpatched,fuselm,liger")
    parser.add_argument("--parallel", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per GPU per step (one sequence)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--merge-into", default=None, help="JSON file to add this world size's results to")
    parser.add_argument("--smoke", action="store_true", help="tiny model (CPU, gloo): checks the script only")
    args = parser.parse_args()
    dist.init_process_group("gloo" if args.smoke or not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if args.smoke else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = {}
    for impl in args.impls.split(","):  # Liger last: it also swaps functions inside transformers' llama module
        if impl == "liger" and not liger_available():
            if rank == 0:
                print("liger-kernel does not import: no Liger row", flush=True)
            continue
        results[impl] = measure(impl, args, device, world)
        gc.collect()  # nothing of this model may stay allocated into the next one's peak
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            r = results[impl]
            print(f"{impl:10s} {world} GPU(s): {r['tok_s']:9.0f} tok/s = {world} x {args.tokens} tokens x "
                  f"{args.steps} steps / {r['step_ms'] * args.steps / 1e3:.2f} s; peak {r['peak_gib_per_gpu']:.1f} "
                  "GiB per GPU", flush=True)
    if rank == 0 and args.merge_into:
        print(json.dumps(merge(Path(args.merge_into), world, args, results)["ratios"]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

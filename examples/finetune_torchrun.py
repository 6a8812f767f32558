"""Fine-tune a causal LM patched by fuselm under torchrun: one process, DDP, or FSDP2's ``fully_shard``.

    # 2 GPUs (NCCL), LoRA on all 7 projections of a Hugging Face checkpoint:
    torchrun --nproc-per-node 2 examples/finetune_torchrun.py --parallel fsdp2 --model meta-llama/Llama-3.2-1B
    # CPU (gloo), the tiny random Llama the tests use, both modes, patched and unpatched:
    torchrun --nproc-per-node 2 examples/finetune_torchrun.py --parallel ddp --runs lora,full,lora-unpatched

Each run builds the model from the same seed, applies ``fuselm.patch`` (unless its name ends in ``-unpatched``),
adds LoRA through PEFT (``lora``) or trains every weight (``full``), wraps it (DDP, or ``fully_shard`` on each
decoder layer and then the root), and takes ``--steps`` AdamW steps on one fixed global batch of
``--batch`` sequences split evenly over the ranks. Equal-length rows with no ignored token give every rank the
same token count, so the ranks' averaged gradient is the gradient of the global batch's mean loss: the losses
and gradients equal one process's on the whole batch (what ``tests/test_examples.py`` checks).

``--out FILE`` (rank 0) saves, per run, the global loss of every step, the first step's full gradients of the
trainable parameters and how many steps took fuselm's fused loss (``torch.save``). ``--checkpoint DIR`` (FSDP2)
saves the sharded model with torch.distributed.checkpoint after training, loads it into a freshly built and
sharded model, and records whether every parameter came back equal. A run named ``full-sharded-head`` also gives
the lm_head its own ``fully_shard``: its weight is then a sharded DTensor outside the lm_head's forward, so
fuselm's fused linear cross-entropy cannot read it and the loss falls back to HF's (lm_head, then the loss on the
logits). A run whose name ends in ``-meta`` (FSDP2) is built, patched and sharded on the meta device, then
materialised: FSDP2's recommended init for a model too large for one device.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import fuselm

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama_config() -> LlamaConfig:
    """A random-weight Llama small enough for CPU: 2 layers, hidden 64, grouped-query attention."""
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False, initializer_range=0.1, pad_token_id=0)


def build(args, run: str, device: torch.device) -> torch.nn.Module:
    """The run's model on ``device``, patched and with LoRA as its name says; a ``-meta`` run's on the meta device
    (its weights come later, see :func:`materialise`)."""
    torch.manual_seed(args.seed)
    with torch.device("meta") if run.endswith("-meta") else contextlib.nullcontext():
        if args.model:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(tiny_llama_config())
    if not run.endswith("-meta"):
        model.to(device)
    model.train()
    if not run.endswith("-unpatched"):
        fuselm.patch(model)
    if run.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                 lora_dropout=0.0, target_modules=PROJECTIONS))
        torch.manual_seed(args.seed + 1)  # LoRA B starts at zero: random B, so that every LoRA weight trains at once
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05)
    return model


def materialise(model: torch.nn.Module, args, run: str, device: torch.device) -> None:
    """FSDP2's recommended init, for a model built, patched and sharded on the meta device: allocate each rank's
    shards on ``device`` and fill them from the whole weights and buffers (here the same model built on the CPU;
    a real run would take them from a checkpoint, as ``set_model_state_dict`` with ``broadcast_from_rank0``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    whole = build(args, run.removesuffix("-meta"), torch.device("cpu"))
    model.to_empty(device=device)
    set_model_state_dict(model, whole.state_dict(), options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():  # non-persistent buffers (RoPE's inv_freq) are in no state dict
        for buffer, value in zip(model.buffers(), whole.buffers()):
            buffer.copy_(value)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def wrap(model: torch.nn.Module, args, run: str, device: torch.device) -> torch.nn.Module:
    if args.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        if run.endswith("sharded-head"):
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            fully_shard(base.lm_head)
        fully_shard(model)
    return model


def global_batch(args, device: torch.device) -> torch.Tensor:
    """[batch, seq_len] token ids, the same on every rank (a fixed generator), avoiding the pad id 0."""
    vocab = tiny_llama_config().vocab_size if not args.model else AutoModelForCausalLM.from_pretrained(
        args.model).config.vocab_size
    generator = torch.Generator().manual_seed(args.seed + 2)
    return torch.randint(1, vocab, (args.batch, args.seq_len), generator=generator).to(device)


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters' gradients, whole (FSDP2's sharded DTensor gradients gathered), on the CPU."""
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad and param.grad is not None:
            grad = param.grad
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads[name.replace("module.", "").replace("_orig_mod.", "")] = grad.detach().float().cpu()
    return grads


def counting_fused_loss_calls() -> list[int]:
    """Counts the calls of fuselm's fused linear cross-entropy by the patched models' loss (a one-element list),
    so that a run can report whether its loss took the fused path or fell back to HF's."""
    from fuselm.patching import loss

    calls, fused = [0], loss.linear_cross_entropy

    def counted(*args, **kwargs):
        calls[0] += 1
        return fused(*args, **kwargs)

    loss.linear_cross_entropy = counted
    return calls


FUSED_LOSS_CALLS = counting_fused_loss_calls()


def train(args, run: str, device: torch.device, rank: int, world: int) -> dict:
    FUSED_LOSS_CALLS[0] = 0
    model = wrap(build(args, run, device), args, run, device)
    if run.endswith("-meta"):
        materialise(model, args, run, device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    tokens = global_batch(args, device)
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} must be a multiple of the world size {world}")
    local = tokens.chunk(world)[rank]
    losses, first_grads = [], None
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=local, labels=local, use_cache=False).loss
        loss.backward()
        if step == 0:
            first_grads = full_gradients(model)
        optimizer.step()
        reported = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reported)
            reported /= world
        losses.append(reported.item())
    result = {"losses": losses, "grads": first_grads, "fused_loss_steps": FUSED_LOSS_CALLS[0]}
    if args.checkpoint and args.parallel == "fsdp2":
        result["checkpoint_round_trip"] = checkpoint_round_trip(model, args, run, device)
    return result


def checkpoint_round_trip(model: torch.nn.Module, args, run: str, device: torch.device) -> bool:
    """Save the sharded model with torch.distributed.checkpoint, load it into a fresh sharded model of the same
    run, and say whether every parameter (gathered) came back equal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = os.path.join(args.checkpoint, run)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    fresh = wrap(build(args, run, device), args, run, device)
    if run.endswith("-meta"):
        fresh.to_empty(device=device)  # every parameter then comes from the checkpoint
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state)
    trained, loaded = dict(model.named_parameters()), dict(fresh.named_parameters())
    return trained.keys() == loaded.keys() and all(
        torch.equal(trained[name].full_tensor(), loaded[name].full_tensor()) for name in trained)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parallel", choices=["none", "ddp", "fsdp2"], default="none")
    parser.add_argument("--runs", default="lora", help="comma-separated: lora, full, full-sharded-head, each "
                                                       "optionally with -unpatched or (FSDP2) -meta")
    parser.add_argument("--model", default=None, help="a Hugging Face checkpoint (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=4, help="global batch: sequences over all ranks")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()

    distributed = "WORLD_SIZE" in os.environ
    if args.parallel != "none" and not distributed:
        parser.error(f"--parallel {args.parallel} runs under torchrun")
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = {}
    for run in args.runs.split(","):
        results[run] = train(args, run, device, rank, world)
        if rank == 0:
            losses = results[run]["losses"]
            print(f"{run} ({args.parallel}, {world} process(es)): loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                  f"in {len(losses)} steps, {results[run]['fused_loss_steps']} with fuselm's fused loss")
    if rank == 0 and args.out:
        torch.save(results, args.out)
    if distributed:
        dist.barrier()  # every rank done with its collectives before any tears its connections down
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

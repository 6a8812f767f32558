"""Fine-tune a causal LM patched by fuselm with Hugging Face ``Trainer``: LoRA through PEFT, or every weight.

    # one process, or DDP / FSDP2 through torchrun or accelerate (the Trainer picks the set-up from the launcher):
    python examples/finetune_trainer.py --out /tmp/one.pt
    torchrun --nproc-per-node 2 examples/finetune_trainer.py --out /tmp/ddp.pt       # DDP (gloo on CPU, or NCCL)
    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/finetune_trainer.py --out /tmp/fsdp2.pt
                                                                                      # FSDP2, 2 GPUs

``fuselm.patch(model)`` is the one line fuselm adds. The data are ``--examples`` fixed sequences of equal length,
one global batch per step (``--batch`` over all processes), so every launch sees the same batches and gives the
same losses. ``--out FILE`` (rank 0) saves the logged loss of every step and the trained parameters
(``torch.save``); ``tests/test_examples.py`` compares the launches. Without ``--model``, the tiny random Llama of
``finetune_torchrun.py``.
"""

from __future__ import annotations

import argparse
import os

import torch
from finetune_torchrun import PROJECTIONS, tiny_llama_config
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

import fuselm


class FixedSequences(Dataset):
    """``count`` random sequences of ``seq_len`` tokens, labels = inputs (the model shifts them)."""

    def __init__(self, count: int, seq_len: int, vocab: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, vocab, (count, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class LossLog(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--mode", choices=["lora", "full"], default="lora")
    parser.add_argument("--no-patch", action="store_true", help="train the unpatched model (for comparison)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="global batch: sequences per step over all processes")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--output-dir", default="/tmp/fuselm-trainer")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(args.seed)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(tiny_llama_config())
    if not args.no_patch:
        fuselm.patch(model)
    if args.mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PROJECTIONS))
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch // world,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=args.seed,
        data_seed=args.seed, dataloader_drop_last=True, disable_tqdm=True)
    log = LossLog()
    data = FixedSequences(args.examples, args.seq_len, model.config.vocab_size, args.seed + 2)
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[log])
    trainer.train()
    sharded = any(type(p).__name__ == "DTensor" for p in trainer.model.parameters())  # FSDP2's parameters
    wrapper = "fsdp2" if sharded else type(trainer.model_wrapped).__name__
    state = trainer.accelerator.get_state_dict(trainer.model)  # gathered from FSDP shards on rank 0
    if trainer.is_world_process_zero() and args.out:
        trainable = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
        params = {name: t.detach().float().cpu() for name, t in state.items()
                  if any(name.endswith(n.replace("module.", "")) for n in trainable)}
        torch.save({"losses": log.losses, "params": params, "world": world, "wrapper": wrapper}, args.out)
        print(f"{args.mode}: losses {log.losses[0]:.4f} -> {log.losses[-1]:.4f} over {len(log.losses)} steps, "
              f"{world} process(es), model wrapped as {wrapper}")


if __name__ == "__main__":
    main()

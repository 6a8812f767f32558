"""The examples under torchrun, 2 processes (CPU: gloo; where two GPUs exist: NCCL, one GPU each).

examples/finetune_torchrun.py: DDP and FSDP2, LoRA and full fine-tuning of a patched tiny Llama give the losses and
gradients of one process on the same global batch, converge in 30 steps, take fuselm's fused loss (or, with a
sharded lm_head, fall back to HF's) and round-trip a sharded checkpoint, also when built on the meta device.
examples/finetune_trainer.py: HF Trainer under torchrun (DDP), and on two GPUs under accelerate with
examples/accelerate_fsdp2.yaml (FSDP2), gives one process's losses and trained weights. Slow: each launch starts
Python processes (~2.5 minutes in all on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import rel_err

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS = 30
TWO_GPUS = torch.cuda.device_count() >= 2
# fp32 everywhere; on GPUs the kernels and NCCL's reductions sum in other orders than one process's
TOLERANCE = 1e-4 if TWO_GPUS else 1e-5


def _run(tmp_path: Path, name: str, launcher: list[str], script: str = "finetune_torchrun.py", *options: str) -> dict:
    out = tmp_path / f"{name}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(EXAMPLES), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the fused modules run their PyTorch references on CPU: quicker
    if not TWO_GPUS:
        env["CUDA_VISIBLE_DEVICES"] = ""  # one GPU cannot hold two ranks: the CPU runs (gloo) there too
    subprocess.run([*launcher, str(EXAMPLES / script), "--out", str(out), *options], check=True, env=env, cwd=ROOT,
                   timeout=600)
    return torch.load(out)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), "single", [sys.executable], "finetune_torchrun.py", "--steps",
                str(STEPS), "--runs", "lora,full,lora-unpatched")


def _assert_matches(got: dict, expected: dict, name: str, tolerance: float = TOLERANCE) -> None:
    losses, expected_losses = torch.tensor(got["losses"]), torch.tensor(expected["losses"])
    assert rel_err(losses[:5], expected_losses[:5]) <= tolerance, (name, losses, expected_losses)
    assert rel_err(losses, expected_losses) <= 100 * tolerance, (name, losses, expected_losses)  # 30 AdamW steps
    assert got["grads"].keys() == expected["grads"].keys()
    for param, grad in got["grads"].items():
        assert rel_err(grad, expected["grads"][param]) <= tolerance, (name, param)


def test_one_process_patched_matches_unpatched_and_converges(single):
    _assert_matches(single["lora"], single["lora-unpatched"], "lora vs unpatched")
    assert single["lora"]["fused_loss_steps"] == STEPS and single["lora-unpatched"]["fused_loss_steps"] == 0
    for run, ratio in [("lora", 0.3), ("full", 0.05)]:
        losses = single[run]["losses"]
        assert losses[-1] < ratio * losses[0], (run, losses)
    assert any("lora_A" in name for name in single["lora"]["grads"])
    assert not any("lora" in name for name in single["full"]["grads"])


def test_ddp_matches_one_process(single, tmp_path):
    ddp = _run(tmp_path, "ddp", TORCHRUN, "finetune_torchrun.py", "--steps", str(STEPS), "--parallel", "ddp",
               "--runs", "lora,full")
    for run in ("lora", "full"):
        _assert_matches(ddp[run], single[run], f"ddp {run}")
        assert ddp[run]["fused_loss_steps"] == STEPS
    _assert_matches(ddp["lora"], single["lora-unpatched"], "ddp lora vs one process unpatched")


def test_fsdp2_matches_one_process_and_round_trips_its_sharded_checkpoint(single, tmp_path):
    fsdp = _run(tmp_path, "fsdp2", TORCHRUN, "finetune_torchrun.py", "--steps", str(STEPS), "--parallel", "fsdp2",
                "--runs", "lora,full,full-sharded-head,lora-meta", "--checkpoint", str(tmp_path / "checkpoints"))
    for run, reference in [("lora", "lora"), ("full", "full"), ("full-sharded-head", "full"), ("lora-meta", "lora")]:
        _assert_matches(fsdp[run], single[reference], f"fsdp2 {run}")
        assert fsdp[run]["checkpoint_round_trip"], run
    assert fsdp["lora"]["fused_loss_steps"] == fsdp["full"]["fused_loss_steps"] == fsdp["lora-meta"][
        "fused_loss_steps"] == STEPS  # lora-meta: built, patched and sharded on the meta device, then materialised
    assert fsdp["full-sharded-head"]["fused_loss_steps"] == 0  # its lm_head's weight is sharded: HF's loss


@pytest.fixture(scope="module")
def trainer_single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("trainer"), "trainer-single", [sys.executable], "finetune_trainer.py")


def _assert_trainer_matches(got: dict, expected: dict, wrapper: str) -> None:
    assert got["world"] == 2 and got["wrapper"] == wrapper, (got["world"], got["wrapper"])
    assert rel_err(torch.tensor(got["losses"]), torch.tensor(expected["losses"])) <= 10 * TOLERANCE
    assert len(got["losses"]) == 10 and got["losses"][-1] < 0.8 * got["losses"][0]
    assert got["params"].keys() == expected["params"].keys() and got["params"]
    for name, param in got["params"].items():
        assert rel_err(param, expected["params"][name]) <= 10 * TOLERANCE, name


def test_trainer_under_torchrun_ddp_matches_one_process(trainer_single, tmp_path):
    ddp = _run(tmp_path, "trainer-ddp", TORCHRUN, "finetune_trainer.py")
    _assert_trainer_matches(ddp, trainer_single, "DistributedDataParallel")


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="accelerate shards with FSDP on GPUs only; needs two")
def test_trainer_under_accelerate_fsdp2_matches_one_process(trainer_single, tmp_path):
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(EXAMPLES / "accelerate_fsdp2.yaml")]
    _assert_trainer_matches(_run(tmp_path, "trainer-fsdp2", launcher, "finetune_trainer.py"), trainer_single, "fsdp2")

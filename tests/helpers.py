"""Shared checks: relative error against a float64 reference, with NaN never passing; the ops that read a device
value back to the host."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fuselm

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_script(name: str, monkeypatch=None) -> ModuleType:
    """``benchmarks/<name>.py`` loaded as a module. With pytest's ``monkeypatch``, benchmarks/ is on ``sys.path``
    for the test, for the script's own imports of its neighbours (timing, training, ...), and the module is in
    ``sys.modules`` under ``name`` while the test runs (its dataclasses look their module up there)."""
    if monkeypatch is not None:
        monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


# ‖out − ref‖ / ‖ref‖ that each dtype must reach against a float64 reference.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    if torch.isnan(out).any() and not torch.isnan(ref).any():
        return float("nan")
    denom = ref.norm()
    return (out - ref).norm().item() / (denom.item() if denom > 0 else 1.0)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, name: str = "output",
                 scale: float = 1.0) -> None:
    """out matches ref to the dtype's tolerance (times ``scale``); NaN in out never passes."""
    err = rel_err(out, ref)
    tol = TOLERANCE[dtype] * scale
    assert err == err and err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e} ({dtype})"


def float64_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().requires_grad_(t.requires_grad)


def randn(*shape, dtype=torch.float32, device="cpu", requires_grad=False, scale=1.0) -> torch.Tensor:
    t = torch.randn(*shape, dtype=torch.float32, device=device) * scale
    return t.to(dtype).requires_grad_(requires_grad)


def grads(outputs, inputs, grad_outputs):
    """Gradients of ``inputs`` for a backward pass fed ``grad_outputs`` (None where unused)."""
    return torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)


def assert_compiles_like_eager(fn, args, leaves) -> None:
    """``torch.compile(fn, fullgraph=True)`` traces the Triton path with no graph break, and its output
    and the gradients of ``leaves`` (fed one random upstream gradient) match eager's in fp32."""
    with fuselm.use_backend("triton"):
        eager = fn(*args)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
        explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0
    assert_close(compiled, eager, torch.float32)
    upstream = torch.randn_like(eager)
    for i, (got, expected) in enumerate(zip(grads(compiled, leaves, upstream), grads(eager, leaves, upstream))):
        assert_close(got, expected, torch.float32, f"gradient of leaf {i}")


def train_lora_steps(model, steps: int = 30, first_grads: dict | None = None):
    """``steps`` AdamW steps (lr 3e-3) of a PEFT LoRA model on five fixed batches of tiny-vocabulary ids; returns
    (losses [steps], the LoRA weights in fp32 on CPU). ``first_grads``, a dict, receives the first step's
    gradients."""
    from tests.models import token_ids

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    batches = [token_ids(2, 8, seed=100 + i) for i in range(5)]
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if first_grads is not None and step == 0:
            first_grads.update({n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return torch.tensor(losses), {n: p.detach().float().cpu() for n, p in model.named_parameters() if "lora_" in n}


class HostSyncs(TorchDispatchMode):
    """Records the ops that read a device value back to the host (each a host sync on a GPU)."""

    READS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.READS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))

"""DTensors (FSDP2's sharded parameters, tensor parallelism) given to fuselm's ops, on CPU with gloo, 2 processes.

rms_norm, add_rms_norm, silu_mul and gelu_tanh_mul run on the local shards (rows sharded, weights replicated) and
return DTensors; their outputs and gradients, gathered, match the float64 reference on the whole tensors. Every
other op refuses a DTensor with a TypeError naming the argument, and the local-shard ops refuse placements their
row-wise arithmetic cannot honour (the last dimension sharded, Partial, a sharded weight)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fuselm
from fuselm.backend import INTERPRETING
from tests.helpers import assert_close

WORLD = 2
# two GPUs: NCCL, one GPU per rank (Triton on the GPU); else CPU with gloo (Triton in the interpreter)
ON_GPUS = torch.cuda.device_count() >= WORLD


def _whole(*shape, requires_grad=False):
    """The same random tensor on every rank (the caller seeds alike), fp32."""
    return torch.randn(*shape).requires_grad_(requires_grad)


def _check_local_shard_ops(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    cases = [  # (name, op on whole tensors, [(whole tensor, placements or None for replicated)])
        ("rms_norm rows", lambda x, w: fuselm.rms_norm(x, w, 1e-6), [(_whole(4, 5, 40), Shard(0)), (_whole(40), None)]),
        ("rms_norm seq", lambda x, w: fuselm.rms_norm(x, w, 1e-6, 1.0, "gemma"),
         [(_whole(2, 7, 40), Shard(1)), (_whole(40), None)]),
        ("add_rms_norm", lambda x, r, w: fuselm.add_rms_norm(x, r, w),
         [(_whole(6, 40), Shard(0)), (_whole(6, 40), Shard(0)), (_whole(40), None)]),
        ("silu_mul", lambda g, u: fuselm.silu_mul(g, u), [(_whole(3, 6, 30), Shard(1)), (_whole(3, 6, 30), Shard(1))]),
        ("gelu_tanh_mul packed", lambda g: fuselm.gelu_tanh_mul(g), [(_whole(5, 30), Shard(0))]),
        ("silu_mul replicated", lambda g, u: fuselm.silu_mul(g, u),
         [(_whole(3, 30), Replicate()), (_whole(3, 30), Replicate())]),
    ]
    for name, op, inputs in cases:
        wholes = [t.requires_grad_(True) for t, _ in inputs]
        distributed = [distribute_tensor(t.detach(), mesh, [p or Replicate()]).requires_grad_(True)
                       for t, p in zip(wholes, (p for _, p in inputs))]
        outputs = op(*distributed)
        outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        with fuselm.use_backend("reference"):
            expected = op(*[t.double() for t in wholes])
        expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
        upstream = [torch.randn(e.shape) for e in expected]
        torch.autograd.backward(expected, [u.double() for u in upstream])
        torch.autograd.backward(outputs, [distribute_tensor(u, mesh, out.placements) for u, out in
                                          zip(upstream, outputs)])
        for i, (out, ref) in enumerate(zip(outputs, expected)):
            assert out.placements == distributed[0].placements, (name, out.placements)
            assert_close(out.full_tensor(), ref, torch.float32, f"{name} output {i}")
        for i, (t, whole) in enumerate(zip(distributed, wholes)):
            assert_close(t.grad.full_tensor(), whole.grad, torch.float32, f"{name} gradient of input {i}")


def _check_refusals(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def dt(t, placement=None):
        return distribute_tensor(t, mesh, [placement or Replicate()])

    x, w = _whole(4, 40), _whole(40)
    refused = [
        (ValueError, r"x is a DTensor placed \(Shard\(dim=1\),\)", lambda: fuselm.rms_norm(dt(x, Shard(1)), w)),
        (ValueError, r"x is a DTensor placed \(Partial", lambda: fuselm.rms_norm(_partial(x, mesh), w)),
        (ValueError, "weight must be replicated", lambda: fuselm.rms_norm(dt(x, Shard(0)), dt(w, Shard(0)))),
        (TypeError, "weight is a DTensor but x is a Tensor", lambda: fuselm.rms_norm(x, dt(w))),
        (ValueError, "up is a DTensor .* placed", lambda: fuselm.silu_mul(dt(x, Shard(0)), dt(x))),
        (TypeError, "up must be a DTensor", lambda: fuselm.silu_mul(dt(x, Shard(0)), x)),
        (ValueError, "residual is a DTensor", lambda: fuselm.add_rms_norm(dt(x, Shard(0)), dt(x), w)),
        (TypeError, "logits is a DTensor", lambda: fuselm.cross_entropy(dt(x), torch.zeros(4, dtype=torch.long))),
        (TypeError, "labels is a DTensor", lambda: fuselm.cross_entropy(x, dt(torch.zeros(4, dtype=torch.long)))),
        (TypeError, "weight is a DTensor", lambda: fuselm.linear_cross_entropy(
            _whole(3, 40), dt(_whole(8, 40), Shard(0)), torch.zeros(3, dtype=torch.long))),
        (TypeError, "q is a DTensor", lambda: fuselm.rope(dt(_whole(1, 2, 3, 8)), _whole(1, 2, 3, 8), _whole(1, 3, 8),
                                                          _whole(1, 3, 8))),
        (TypeError, "k_cache is a DTensor", lambda: fuselm.decode_attention(
            _whole(1, 2, 1, 64), dt(_whole(1, 2, 4, 64)), _whole(1, 2, 4, 64), torch.zeros(1, dtype=torch.long),
            torch.full((1,), 4))),
        (TypeError, "weight is a DTensor", lambda: fuselm.linear_residual(x, dt(_whole(8, 40)), _whole(4, 8))),
        (TypeError, "gate_weight is a DTensor", lambda: fuselm.norm_gated_linear(x, w, 1e-6, dt(_whole(8, 40)))),
        (TypeError, "q_weight is a DTensor", lambda: fuselm.qkv_rope(
            _whole(1, 1, 40), w, 1e-6, dt(_whole(16, 40)), _whole(8, 40), _whole(8, 40), _whole(1, 1, 8),
            _whole(1, 1, 8), _whole(1, 1, 4, 8), _whole(1, 1, 4, 8), torch.zeros(1, dtype=torch.long),
            num_heads=2, num_kv_heads=1)),
    ]
    for error, message, call in refused:
        with pytest.raises(error, match=message):
            call()


def _partial(x, mesh):
    from torch.distributed.tensor import DTensor, Partial

    return DTensor.from_local(x / WORLD, mesh, [Partial()])


def _worker(rank: int, backend: str, store: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    if ON_GPUS:
        torch.cuda.set_device(rank)
        torch.set_default_device("cuda")  # every tensor of the cases on this rank's GPU
    dist.init_process_group("nccl" if ON_GPUS else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    try:
        mesh = init_device_mesh("cuda" if ON_GPUS else "cpu", (WORLD,))
        torch.manual_seed(0)  # the same whole tensors on every rank
        with fuselm.use_backend(backend):
            _check_local_shard_ops(mesh)
            _check_refusals(mesh)
        del mesh
        dist.barrier()  # neither rank tears its connections down while the other still uses them
    finally:
        dist.destroy_process_group()
    # Passed. A spawned child leaves through sys.exit, whose interpreter teardown once aborted in CI ("terminate
    # called without an active exception": gloo's threads met C++ static destruction). Nothing is left to check,
    # so leave as fork's children do; a failure above still raises, and mp.spawn reports it with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_dtensors_run_on_local_shards_or_are_refused_by_name(backend, tmp_path):
    if backend == "triton" and not (ON_GPUS or INTERPRETING):
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET, which conftest sets only without CUDA")
    mp.spawn(_worker, args=(backend, str(tmp_path / "store")), nprocs=WORLD)

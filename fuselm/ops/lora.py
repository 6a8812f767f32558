"""LoRA's branch added to its base projection, ``out = base_out + scaling * (x Aᵀ) Bᵀ``: PyTorch reference and the
``fuselm::`` op. Up to :data:`MAX_SHARED` projections of one input (q/k/v, gate/up) share one read of x.

Shapes: x [..., K]; per projection, base_out [..., N] (the base layer's output, any base: ``nn.Linear``, a
bitsandbytes 4-bit linear, ...), A [r, K], B [N, r], ``scaling`` a float (alpha / r, or alpha / sqrt(r) for rsLoRA).

PEFT (``autocast_adapter_dtype=True``, its default) keeps A and B in fp32 and, per LoRA layer, casts x to an fp32
copy, runs both adapter GEMMs in fp32 (SIMT, no tensor cores), makes an fp32 [..., N] product, scales it, adds the
base output promoted to fp32 and casts the sum back: several full-size fp32 passes, and an fp32 copy of x kept for
backward by every LoRA layer. The fused path instead computes in x's dtype on tensor cores with fp32 accumulation,
casting only the small adapters (A, B: r·(K + N) elements) to x's dtype; no fp32 copy of x exists:

    adapters  A'_cat = [s₁A₁; s₂A₂; ...], B_i     in x's dtype, once per call (small: r·(K + N) elements)
    forward   t' = x A'_catᵀ                         one GEMM for the group, [M, Σr], x read once
              out_i = base_i + t'_i B_iᵀ              cuBLAS addmm: fp32 accumulate, one rounding in the epilogue
    backward  u_i = dy_i B_i                         [M, r_i]
              dx = [u₁ | u₂ | ...] A'_cat            one GEMM for the group (the LoRA part of dx only)
              [dA₁; dA₂; ...] = s ⊙ [u₁ | ...]ᵀ x     one GEMM for the group, fp32 out (the adapters' grads stay fp32)
              dB_i = dy_iᵀ t'_i                      bf16/fp16 inputs, fp32 output
              d base_i = dy_i                        (the base layer's own autograd carries it on: frozen weights)

Saved for backward: x (in its dtype; one tensor for the whole group), t' ([M, Σr], r/K of x's size) and the cast
adapters; nothing in fp32, nothing of size [M, N]. The down projection's x, the GLU's output, is not kept: given
``glu_inputs`` backward recomputes it from gate and up, which the GLU's backward keeps anyway (one elementwise pass
instead of [M, I] more memory per layer). t' goes through HBM once each way: it is Σr columns wide, and keeping it
(rather than recomputing x Aᵀ) saves a read of x in backward. Every step is a cuBLAS GEMM whose epilogue does the
adds; no elementwise kernel is left to fuse, so there is no Triton kernel here (a Triton GEMM would have to beat
cuBLAS on the base-sized products). The base GEMM stays the base layer's own call, so quantised bases work alike
(the patched model groups bitsandbytes 4-bit bases of one input: ``patching/quantized.py``).
A q/k/v group takes 9 launches forward and 10 backward, gate/up 7 and 8, o and down 4 and 5 each: 52 per layer (91
before the adapters were cast once per call and the A gradients batched). The step is host-bound at 4096 tokens,
so launches count (benchmarks/NOTES.md).

``lora_linear`` takes the base too when it is a frozen ``nn.Linear`` (weights read in place, bias optional): the base
GEMM x Wᵀ is cuBLAS's as in the layer's own call, the branch is added into its output in place, and backward sums
the group's input gradient in one buffer, dx = u A'_cat, then dx += dy_i W_i per projection (addmm accumulating in
its epilogue). Left to autograd, the base layers are nodes of their own and x's gradient is a sum of 2-4 tensors
(one add kernel and one full [M, K] pass each: ~7 per layer, 7 ms per step of Llama-3-8B at 4096 tokens).

Both paths give ``out`` in base_out's dtype. The reference is PEFT's own arithmetic (fp32 branch when A is fp32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fuselm.backend import runs_triton
from fuselm.ops._common import FusedOp, as_rows, check_real, check_same, check_same_device, check_tensor
from fuselm.ops.glu import gelu_tanh_mul, silu_mul

MAX_SHARED = 3  # projections of one input in one op call: q/k/v
GATED = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}
_MM_FP32_OUT = "dtype" in torch.ops.aten.mm.overloads()  # torch.mm(..., out_dtype=): torch >= 2.8 on CUDA


# ----------------------------------------------------------------------------------- reference
def lora_add_reference(x: Tensor, base_out: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    """PEFT's LoRA arithmetic: ``(base_out + B(A(x in A's dtype)) * scaling)`` in base_out's dtype. Shapes as
    :func:`lora_add`."""
    branch = F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b) * scaling
    return (base_out + branch).to(base_out.dtype)


# ----------------------------------------------------------------------------------- fused path
def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with fp32 accumulation and an fp32 result, on tensor cores for half-precision a and b."""
    if a.dtype == torch.float32:
        return a @ b
    if a.is_cuda and _MM_FP32_OUT:
        return torch.mm(a, b, out_dtype=torch.float32)
    if a.is_cuda:  # older torch: the product rounded to a's dtype
        return (a @ b).float()
    return a.float() @ b.float()  # CPU: products of half-precision numbers are exact in fp32, as on tensor cores


def _projections(args: tuple) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(base_out, A, B) per projection in the op's flat arguments (base0, a0, b0, base1, ...; None after the last)."""
    return [tuple(args[i:i + 3]) for i in range(0, 3 * MAX_SHARED, 3) if args[i] is not None]


def _scale_rows(matrix: Tensor, ranks: Sequence[int], scalings: Sequence[float]) -> Tensor:
    """``matrix`` [Σr, ...] with its row block i (r_i rows) multiplied by scalings[i], in place."""
    if len(set(scalings)) == 1:
        return matrix.mul_(scalings[0]) if scalings[0] != 1 else matrix
    for block, scaling in zip(matrix.split(list(ranks)), scalings):
        block.mul_(scaling)
    return matrix


def _half_adapters(projections: list[tuple[Tensor, Tensor, Tensor]], scalings: Sequence[float],
                   dtype: torch.dtype) -> list[Tensor]:
    """[A'_cat, B_1, B_2, ...] in ``dtype``: the group's A matrices times their scalings, stacked [Σr, K], and each B
    [N_i, r_i], one small kernel each (the step's only casts of the adapters: backward reuses them). Always new
    tensors, never an alias of an input."""
    lora_as = [a for _, a, _ in projections]
    a_cat = torch.cat(lora_as) if len(lora_as) > 1 else lora_as[0]
    if len(set(scalings)) == 1:
        a_cat = torch.mul(a_cat, scalings[0], out=a_cat.new_empty(a_cat.shape, dtype=dtype))
    else:
        a_cat = _scale_rows(a_cat.to(dtype, copy=len(lora_as) == 1), [a.shape[0] for a in lora_as], scalings)
    return [a_cat, *(b.to(dtype, copy=True) for _, _, b in projections)]


def _lora_add_impl(x: Tensor, base0: Tensor, a0: Tensor, b0: Tensor, base1: Tensor | None, a1: Tensor | None,
                   b1: Tensor | None, base2: Tensor | None, a2: Tensor | None, b2: Tensor | None,
                   gate: Tensor | None, up: Tensor | None, scalings: list[float], activation: str) -> list[Tensor]:
    """[out_0, ..., out_{n-1}, t', A'_cat, B_0, ...]: t' = x A'_catᵀ [M, Σr] and the adapters in x's dtype
    (:func:`_half_adapters`), returned for backward (not differentiable). ``gate`` given: x is
    ``GATED[activation](gate, up)``, which backward recomputes instead of keeping x."""
    projections = _projections((base0, a0, b0, base1, a1, b1, base2, a2, b2))
    with torch.autocast(x.device.type, enabled=False):
        rows = as_rows(x)
        a_cat, *half_bs = _half_adapters(projections, scalings, x.dtype)
        t = rows @ a_cat.t()
        outs, start = [], 0
        for (base, _, _), half_b in zip(projections, half_bs):
            rank = half_b.shape[1]
            outs.append(torch.addmm(as_rows(base), t[:, start:start + rank], half_b.t()).view(base.shape))
            start += rank
    return [*outs, t, a_cat, *half_bs]


def _lora_add_fake(x, base0, a0, b0, base1, a1, b1, base2, a2, b2, gate, up, scalings, activation):
    projections = _projections((base0, a0, b0, base1, a1, b1, base2, a2, b2))
    rank = sum(a.shape[0] for _, a, _ in projections)
    return ([base.new_empty(base.shape) for base, _, _ in projections]
            + [x.new_empty((x.numel() // x.shape[-1], rank)), x.new_empty((rank, x.shape[-1]))]
            + [b.new_empty(b.shape, dtype=x.dtype) for _, _, b in projections])


def _save_for_branch(ctx, inputs, output, adapters: list[Tensor], weights: tuple[Tensor, ...] = ()) -> None:
    """What both ops' backward needs: x (or the GLU's inputs it is made from, which the GLU's own backward keeps
    anyway), t', A'_cat and the Bs (``output`` after the projections), then ``weights``; the adapters' dtypes."""
    x, *_, gate, up, scalings, activation = inputs
    internals = output[len(adapters):]  # t', A'_cat and the Bs
    ctx.mark_non_differentiable(*internals)
    ctx.set_materialize_grads(False)  # an output nobody used (t, or a projection) gets None, not zeros
    kept = (x, None) if gate is None else (gate, up)
    ctx.save_for_backward(*kept, *internals, *weights)
    ctx.adapter_dtypes = [a.dtype for a in adapters]
    ctx.scalings, ctx.activation, ctx.recompute = scalings, activation, gate is not None
    ctx.x_shape = x.shape


def _setup_lora_add(ctx, inputs, output):
    _save_for_branch(ctx, inputs, output, [a for _, a, _ in _projections(tuple(inputs[1:-4]))])


def _branch_grads(ctx, dys: list[Tensor | None], rows: Tensor, t: Tensor, half_bs: list[Tensor],
                  need_a: list[bool], need_b: list[bool]) -> tuple[Tensor, list[Tensor | None], list[Tensor | None]]:
    """The branch's backward for row-shaped output gradients ``dys`` (None: an output nobody used): u = [u_1 | u_2 |
    ...] [M, Σr] with u_i = dy_i B_i, and per projection dA_i (all in one GEMM: s ⊙ uᵀ x) and dB_i = dy_iᵀ t'_i, in
    the adapters' dtypes; None where not needed. An unused output's rows of u are zeros."""
    ranks = [b.shape[1] for b in half_bs]
    grad_as, grad_bs = [None] * len(half_bs), [None] * len(half_bs)
    us, start = [], 0
    for i, (dy, half_b, rank) in enumerate(zip(dys, half_bs, ranks)):
        if dy is None:
            us.append(rows.new_zeros((rows.shape[0], rank)))
        else:
            us.append(dy @ half_b)
            if need_b[i]:
                grad_bs[i] = _mm_fp32(dy.t(), t[:, start:start + rank]).to(ctx.adapter_dtypes[i])
        start += rank
    u = torch.cat(us, dim=1) if len(us) > 1 else us[0]
    wanted = [need and dy is not None for need, dy in zip(need_a, dys)]
    if any(wanted):
        for i, grad in enumerate(_scale_rows(_mm_fp32(u.t(), rows), ranks, ctx.scalings).split(ranks)):
            grad_as[i] = grad.to(ctx.adapter_dtypes[i]) if wanted[i] else None
    return u, grad_as, grad_bs


def _branch_backward(ctx, saved: tuple[Tensor, ...], grads, stride: int, a_at: int
                     ) -> tuple[Tensor, list[Tensor | None], Tensor, list[Tensor | None], list[Tensor | None]]:
    """Both ops' shared backward, from their ``saved`` tensors (:func:`_save_for_branch`): x as [M, K] rows (kept,
    or made again from the GLU's inputs), the projections' output gradients as rows, and u, dA, dB from
    :func:`_branch_grads`. Projection i's A and B are inputs ``a_at + stride * i`` and the one after it."""
    x, up, t, _, *rest = saved
    n = len(ctx.adapter_dtypes)
    if ctx.recompute:
        with torch.no_grad():
            x = GATED[ctx.activation](x, up)
    rows = as_rows(x)
    dys = [None if dy is None else as_rows(dy) for dy in grads[:n]]
    needs = ctx.needs_input_grad
    u, grad_as, grad_bs = _branch_grads(ctx, dys, rows, t, rest[:n], [needs[a_at + stride * i] for i in range(n)],
                                        [needs[a_at + 1 + stride * i] for i in range(n)])
    return rows, dys, u, grad_as, grad_bs


def _backward_lora_add(ctx, grads):
    """dx = u A'_cat (the branch's part; the base outputs' gradients pass through), with u, dA, dB from
    :func:`_branch_grads`."""
    needs, n, saved = ctx.needs_input_grad, len(ctx.adapter_dtypes), ctx.saved_tensors
    result = [None] * (1 + 3 * MAX_SHARED + 4)
    with torch.autocast(saved[2].device.type, enabled=False):
        _, _, u, grad_as, grad_bs = _branch_backward(ctx, saved, grads, 3, 2)
        for i in range(n):
            result[1 + 3 * i] = grads[i] if needs[1 + 3 * i] else None
            result[2 + 3 * i], result[3 + 3 * i] = grad_as[i], grad_bs[i]
        if needs[0]:
            result[0] = (u @ saved[3]).view(ctx.x_shape)
    return tuple(result)


LORA_ADD = FusedOp("lora_add", _lora_add_impl, fake=_lora_add_fake, setup_context=_setup_lora_add,
                   backward=_backward_lora_add)


def _linears(args: tuple) -> list[tuple[Tensor, Tensor | None, Tensor, Tensor]]:
    """(weight, bias, A, B) per projection in ``lora_linear``'s flat arguments (w0, bias0, a0, b0, w1, ...)."""
    return [tuple(args[i:i + 4]) for i in range(0, 4 * MAX_SHARED, 4) if args[i] is not None]


def _lora_linear_impl(x: Tensor, w0: Tensor, bias0: Tensor | None, a0: Tensor, b0: Tensor, w1: Tensor | None,
                      bias1: Tensor | None, a1: Tensor | None, b1: Tensor | None, w2: Tensor | None,
                      bias2: Tensor | None, a2: Tensor | None, b2: Tensor | None, gate: Tensor | None,
                      up: Tensor | None, scalings: list[float], activation: str) -> list[Tensor]:
    """[out_0, ..., t', A'_cat, B_0, ...] as :func:`_lora_add_impl`'s, with each base output made here: x Wᵀ (+ bias)
    by cuBLAS, then the branch added into it in place (an addmm reading it back in its epilogue)."""
    linears = _linears((w0, bias0, a0, b0, w1, bias1, a1, b1, w2, bias2, a2, b2))
    with torch.autocast(x.device.type, enabled=False):
        rows = as_rows(x)
        a_cat, *half_bs = _half_adapters([(None, a, b) for _, _, a, b in linears], scalings, x.dtype)
        t = rows @ a_cat.t()
        outs = []
        for (weight, bias, _, _), half_b, t_part in zip(linears, half_bs, t.split([b.shape[1] for b in half_bs], 1)):
            base = rows @ weight.t() if bias is None else torch.addmm(bias, rows, weight.t())
            outs.append(base.addmm_(t_part, half_b.t()).view(*x.shape[:-1], weight.shape[0]))
    return [*outs, t, a_cat, *half_bs]


def _lora_linear_fake(x, w0, bias0, a0, b0, w1, bias1, a1, b1, w2, bias2, a2, b2, gate, up, scalings, activation):
    linears = _linears((w0, bias0, a0, b0, w1, bias1, a1, b1, w2, bias2, a2, b2))
    rank = sum(a.shape[0] for _, _, a, _ in linears)
    return ([x.new_empty((*x.shape[:-1], w.shape[0])) for w, _, _, _ in linears]
            + [x.new_empty((x.numel() // x.shape[-1], rank)), x.new_empty((rank, x.shape[-1]))]
            + [b.new_empty(b.shape, dtype=x.dtype) for _, _, _, b in linears])


def _setup_lora_linear(ctx, inputs, output):
    linears = _linears(tuple(inputs[1:-4]))
    _save_for_branch(ctx, inputs, output, [a for _, _, a, _ in linears], tuple(w for w, _, _, _ in linears))


def _backward_lora_linear(ctx, grads):
    """dx = u A'_cat + Σ_i dy_i W_i, accumulated in one buffer by addmm (no separate add per projection, as autograd
    makes when the base layers are nodes of their own); dW_i = dy_iᵀ x and dbias_i = Σ dy_i only when asked (the
    frozen bases of LoRA ask for neither); u, dA, dB from :func:`_branch_grads`."""
    needs, n, saved = ctx.needs_input_grad, len(ctx.adapter_dtypes), ctx.saved_tensors
    a_cat, weights = saved[3], saved[4 + n:]
    result = [None] * (1 + 4 * MAX_SHARED + 4)
    with torch.autocast(a_cat.device.type, enabled=False):
        rows, dys, u, grad_as, grad_bs = _branch_backward(ctx, saved, grads, 4, 3)
        for i, dy in enumerate(dys):
            result[3 + 4 * i], result[4 + 4 * i] = grad_as[i], grad_bs[i]
            if dy is not None and needs[1 + 4 * i]:
                result[1 + 4 * i] = dy.t() @ rows
            if dy is not None and needs[2 + 4 * i]:
                result[2 + 4 * i] = dy.sum(0)
        if needs[0]:
            dx = u @ a_cat
            for dy, weight in zip(dys, weights):
                if dy is not None:
                    dx.addmm_(dy, weight)
            result[0] = dx.view(ctx.x_shape)
    return tuple(result)


LORA_LINEAR = FusedOp("lora_linear", _lora_linear_impl, fake=_lora_linear_fake, setup_context=_setup_lora_linear,
                      backward=_backward_lora_linear)


# ----------------------------------------------------------------------------------- public API
def _check_adapters(x: Tensor, bases: str, widths: Sequence[int], lora_as: Sequence[Tensor],
                    lora_bs: Sequence[Tensor], scalings: Sequence[float]) -> list[float]:
    """x, and per projection (``widths``: its N) A [r, K] and B [N, r] in one dtype on x's device; the scalings as
    floats. ``bases`` names the base argument in the count error."""
    check_tensor("x", x)
    if not 1 <= len(widths) <= MAX_SHARED or not len(widths) == len(lora_as) == len(lora_bs) == len(scalings):
        raise ValueError(f"{bases}, lora_as, lora_bs and scalings must have one entry per projection (1 to "
                         f"{MAX_SHARED}), got {len(widths)}, {len(lora_as)}, {len(lora_bs)}, {len(scalings)}")
    in_features = x.shape[-1]
    for i, (width, a, b) in enumerate(zip(widths, lora_as, lora_bs)):
        check_tensor(f"lora_as[{i}]", a, rank=2)
        check_tensor(f"lora_bs[{i}]", b, rank=2)
        if a.shape[1] != in_features or b.shape != (width, a.shape[0]) or a.shape[0] == 0:
            raise ValueError(f"lora_as[{i}] must be [r, {in_features}] and lora_bs[{i}] [{width}, r] with "
                             f"r >= 1, got {tuple(a.shape)} and {tuple(b.shape)}")
        if b.dtype != a.dtype:
            raise TypeError(f"lora_bs[{i}] has dtype {b.dtype} but lora_as[{i}] has dtype {a.dtype}")
        check_same_device("x", x, **{f"lora_as[{i}]": a, f"lora_bs[{i}]": b})
    return [check_real(f"scalings[{i}]", s) for i, s in enumerate(scalings)]


def _check(x: Tensor, base_outs: Sequence[Tensor], lora_as: Sequence[Tensor], lora_bs: Sequence[Tensor],
           scalings: Sequence[float]) -> list[float]:
    check_tensor("x", x)
    for i, base in enumerate(base_outs):
        check_tensor(f"base_outs[{i}]", base)
        if base.shape[:-1] != x.shape[:-1]:
            raise ValueError(f"base_outs[{i}] has shape {tuple(base.shape)} but x has shape {tuple(x.shape)}: "
                             "their leading dimensions must agree")
    scalings = _check_adapters(x, "base_outs", [base.shape[-1] for base in base_outs], lora_as, lora_bs, scalings)
    for i, base in enumerate(base_outs):
        check_same("x", x, **{f"base_outs[{i}]": base})
    return scalings


def _check_linears(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None], lora_as: Sequence[Tensor],
                   lora_bs: Sequence[Tensor], scalings: Sequence[float]) -> list[float]:
    check_tensor("x", x)
    if len(biases) != len(weights):
        raise ValueError(f"biases must have one entry (a tensor or None) per weight, got {len(biases)} for "
                         f"{len(weights)} weights")
    for i, (weight, bias) in enumerate(zip(weights, biases)):
        check_tensor(f"weights[{i}]", weight, rank=2)
        if weight.shape[1] != x.shape[-1]:
            raise ValueError(f"weights[{i}] must be [N, {x.shape[-1]}] (x's last dimension), got "
                             f"{tuple(weight.shape)}")
        if bias is not None and check_tensor(f"biases[{i}]", bias).shape != weight.shape[:1]:
            raise ValueError(f"biases[{i}] must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    scalings = _check_adapters(x, "weights", [weight.shape[0] for weight in weights], lora_as, lora_bs, scalings)
    for i, (weight, bias) in enumerate(zip(weights, biases)):
        check_same("x", x, **{f"weights[{i}]": weight, f"biases[{i}]": bias})
    return scalings


def lora_add_shared(x: Tensor, base_outs: Sequence[Tensor], lora_as: Sequence[Tensor], lora_bs: Sequence[Tensor],
                    scalings: Sequence[float], *, glu_inputs: tuple[Tensor, Tensor | None, str] | None = None
                    ) -> list[Tensor]:
    """:func:`lora_add` for up to three projections of the same input (q/k/v, gate/up): x is read once.

    Args:
        x: [..., K], fp32/fp16/bf16 (any float dtype on the reference path).
        base_outs: per projection its base layer's output [..., N_i], in x's dtype.
        lora_as: per projection A [r_i, K]; lora_bs: B [N_i, r_i], B in A's dtype (any float dtype, e.g. fp32 masters).
        scalings: per projection a Python float.
        glu_inputs: (gate, up, activation) when x is ``silu_mul(gate, up)`` or ``gelu_tanh_mul(gate, up)``
            (activation "silu" or "gelu_tanh"; up None: gate is the packed [..., 2K] tensor), the down projection's
            input: backward then recomputes x from them (which the GLU's backward keeps anyway) instead of keeping x.

    Returns:
        per projection ``base_out + scaling * (x Aᵀ) Bᵀ`` [..., N_i] in x's dtype. Gradients flow to x (the LoRA
        part; the base output's gradient is passed to the base layer unchanged), the base outputs, A and B.
    """
    scalings = _check(x, base_outs, lora_as, lora_bs, scalings)
    gate, up, activation = _check_glu_inputs(x, glu_inputs)
    if not runs_triton(x):
        return [lora_add_reference(x, *args) for args in zip(base_outs, lora_as, lora_bs, scalings)]
    flat = [tensor for projection in zip(base_outs, lora_as, lora_bs) for tensor in projection]
    flat += [None] * (3 * MAX_SHARED - len(flat))
    return LORA_ADD(x, *flat, gate, up, scalings, activation)[:len(base_outs)]


def _check_glu_inputs(x: Tensor, glu_inputs: tuple | None) -> tuple[Tensor | None, Tensor | None, str]:
    if glu_inputs is None:
        return None, None, "silu"
    gate, up, activation = glu_inputs
    if activation not in GATED:
        raise ValueError(f"glu_inputs' activation must be one of {tuple(GATED)}, got {activation!r}")
    width = x.shape[-1] * (2 if up is None else 1)
    if check_tensor("glu_inputs' gate", gate).shape != (*x.shape[:-1], width):
        raise ValueError(f"glu_inputs' gate has shape {tuple(gate.shape)}, but x {tuple(x.shape)} is made from it")
    if up is not None and check_tensor("glu_inputs' up", up).shape != gate.shape:
        raise ValueError(f"glu_inputs' up has shape {tuple(up.shape)} but its gate has shape {tuple(gate.shape)}")
    check_same("x", x, **{"glu_inputs' gate": gate, "glu_inputs' up": up})
    return gate, up, activation


def lora_add(x: Tensor, base_out: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float, *,
             glu_inputs: tuple[Tensor, Tensor | None, str] | None = None) -> Tensor:
    """A LoRA layer's output: ``base_out + scaling * (x Aᵀ) Bᵀ`` (the module docstring says how it is computed).

    Args:
        x: [..., K] the layer's input, fp32/fp16/bf16 (any float dtype on the reference path).
        base_out: [..., N] the base layer's output for x, in x's dtype.
        lora_a: A [r, K]; lora_b: B [N, r], in one float dtype (fp32 as PEFT keeps them, or x's).
        scaling: a Python float (alpha / r; alpha / sqrt(r) for rsLoRA).
        glu_inputs: as :func:`lora_add_shared`'s (the down projection: x recomputed in backward).

    Returns:
        [..., N] in x's dtype.
    """
    return lora_add_shared(x, [base_out], [lora_a], [lora_b], [scaling], glu_inputs=glu_inputs)[0]


def lora_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                          scaling: float) -> Tensor:
    """PEFT's LoRA linear: its ``nn.Linear`` base, ``F.linear(x, weight, bias)``, plus the branch as
    :func:`lora_add_reference` adds it. Shapes as :func:`lora_linear`."""
    return lora_add_reference(x, F.linear(x, weight, bias), lora_a, lora_b, scaling)


def lora_linear_shared(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None],
                       lora_as: Sequence[Tensor], lora_bs: Sequence[Tensor], scalings: Sequence[float], *,
                       glu_inputs: tuple[Tensor, Tensor | None, str] | None = None) -> list[Tensor]:
    """:func:`lora_linear` for up to three projections of the same input (q/k/v, gate/up): x is read once for the
    branches, and backward sums the group's input gradient, u A'_cat + Σ dy_i W_i, in one buffer.

    Args:
        x: [..., K], fp32/fp16/bf16 (any float dtype on the reference path).
        weights: per projection its base ``nn.Linear``'s weight W_i [N_i, K], in x's dtype (read in place).
        biases: per projection its bias [N_i] in x's dtype, or None.
        lora_as, lora_bs, scalings, glu_inputs: as :func:`lora_add_shared`'s.

    Returns:
        per projection ``x W_iᵀ + bias_i + scaling_i * (x A_iᵀ) B_iᵀ`` [..., N_i] in x's dtype. Gradients flow to x,
        A and B, and to a weight or bias that requires them (LoRA's frozen bases do not).
    """
    scalings = _check_linears(x, weights, biases, lora_as, lora_bs, scalings)
    gate, up, activation = _check_glu_inputs(x, glu_inputs)
    if not runs_triton(x):
        return [lora_linear_reference(x, *args) for args in zip(weights, biases, lora_as, lora_bs, scalings)]
    flat = [tensor for projection in zip(weights, biases, lora_as, lora_bs) for tensor in projection]
    flat += [None] * (4 * MAX_SHARED - len(flat))
    return LORA_LINEAR(x, *flat, gate, up, scalings, activation)[:len(weights)]


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor, scaling: float, *,
                glu_inputs: tuple[Tensor, Tensor | None, str] | None = None) -> Tensor:
    """A PEFT LoRA linear layer's output, base included: ``x Wᵀ + bias + scaling * (x Aᵀ) Bᵀ``. The base GEMM is
    cuBLAS's on the layer's own weight (no copy); the branch is :func:`lora_add`'s, added into the base's output in
    place; backward adds the branch's input gradient into the base's in the same buffer.

    Args:
        x: [..., K] the layer's input, fp32/fp16/bf16 (any float dtype on the reference path).
        weight: [N, K] the base linear's weight, in x's dtype; bias: [N] in x's dtype, or None.
        lora_a: A [r, K]; lora_b: B [N, r], in one float dtype (fp32 as PEFT keeps them, or x's).
        scaling: a Python float (alpha / r; alpha / sqrt(r) for rsLoRA).
        glu_inputs: as :func:`lora_add_shared`'s (the down projection: x recomputed in backward).

    Returns:
        [..., N] in x's dtype.
    """
    return lora_linear_shared(x, [weight], [bias], [lora_a], [lora_b], [scaling], glu_inputs=glu_inputs)[0]

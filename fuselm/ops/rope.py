"""Rotary position embedding (HF's rotate_half convention): Triton kernel, PyTorch reference, ``fuselm::`` ops.

For each head vector x of q and k at position s, with R = rotary_dim (cos.shape[-1]), h = R / 2,
x1 = x[:h], x2 = x[h:R], c = cos[b, s], n = sin[b, s]::

    out[:h]  = x1 * c[:h]  - x2 * n[:h]
    out[h:R] = x2 * c[h:R] + x1 * n[h:R]
    out[R:]  = x[R:]                        (partial rotary, as Phi-3 / Phi-4-mini use)

computed in fp32 and stored in q's dtype. The two halves of cos/sin are read separately, never assumed
equal. Gradients flow to q and k only; when cos or sin needs a gradient the PyTorch reference runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fuselm.backend import runs_triton
from fuselm.ops._common import (
    FusedOp,
    autotune,
    check_same,
    check_same_device,
    check_tensor,
    new_output,
    new_output_like,
)
from fuselm.ops._triton import tl, triton

LAYOUTS = ("bhsd", "bshd")
MAX_TILE = 8192  # elements of one [positions, heads, h] tile that a program keeps in registers


# ----------------------------------------------------------------------------------- reference
def _rotate_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    x_rot = x[..., :rotary_dim].to(cos.dtype)
    x1, x2 = x_rot[..., :half], x_rot[..., half:]
    rotated = (x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    out = torch.empty_like(x)  # x's memory order (dense x), as the kernel's output
    out[..., :rotary_dim], out[..., rotary_dim:] = rotated, x[..., rotary_dim:]
    return out


def rope_reference(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str = "bhsd") -> tuple[Tensor, Tensor]:
    """Plain PyTorch rotary embedding (the fallback and the test oracle). Shapes as :func:`rope`.

    Computes in ``promote_types(q.dtype, float32)`` (fp32 for half types, fp64 for fp64), stores in q's dtype.
    """
    head_axis = 1 if layout == "bhsd" else 2
    work = torch.promote_types(q.dtype, torch.float32)
    cos, sin = cos.unsqueeze(head_axis).to(work), sin.unsqueeze(head_axis).to(work)
    return _rotate_reference(q, cos, sin), _rotate_reference(k, cos, sin)


# ----------------------------------------------------------------------------------- kernel
def _prune_by_registers(configs, named_args, **kwargs):
    block_half = {**named_args, **kwargs}["BLOCK_HALF"]
    kept = [c for c in configs if c.kwargs["BLOCK_S"] * c.kwargs["BLOCK_H"] * block_half <= MAX_TILE]
    return kept or configs[:1]


_CONFIGS = [  # (positions, heads) per tile; the first is the one the interpreter runs
    triton.Config({"BLOCK_S": s, "BLOCK_H": h}, num_warps=w)
    for s, h, w in [(2, 4, 4), (4, 4, 4), (8, 4, 4), (16, 2, 4), (8, 8, 4), (16, 4, 4), (32, 2, 4), (16, 8, 8),
                    (32, 4, 8), (64, 2, 8),
                    # many positions per head: in [B, H, S, D] memory a tile is BLOCK_H runs of
                    # BLOCK_S * D contiguous elements, so these move fewer, longer runs
                    (64, 1, 4), (128, 1, 8)]
]


@triton.jit
def _rotate_heads(x_ptr, y_ptr, b, s, s_ok, heads, d, c1, c2, n1, n2, n_heads, half, head_dim,
                  stride_xb, stride_xs, stride_xh, stride_xd, stride_yb, stride_ys, stride_yh, stride_yd,
                  COPY_TAIL: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    """Rotates heads ([1, BLOCK_H, 1]; those >= n_heads masked off) of x at positions s ([BLOCK_S, 1, 1])
    of batch row b into y: one [BLOCK_S, BLOCK_H, D] tile read once and written once.

    c1/c2/n1/n2 are the [BLOCK_S, 1, BLOCK_HALF] cos/sin halves; d indexes the first half.
    """
    row_ok = s_ok & (heads < n_heads)
    mask = row_ok & (d < half)
    x_head = x_ptr + b * stride_xb + s * stride_xs + heads * stride_xh
    y_head = y_ptr + b * stride_yb + s * stride_ys + heads * stride_yh
    x1 = tl.load(x_head + d * stride_xd, mask=mask).to(tl.float32)
    x2 = tl.load(x_head + (d + half) * stride_xd, mask=mask).to(tl.float32)
    tl.store(y_head + d * stride_yd, (x1 * c1 - x2 * n1).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_head + (d + half) * stride_yd, (x2 * c2 + x1 * n2).to(y_ptr.dtype.element_ty), mask=mask)
    if COPY_TAIL:
        tail = 2 * half + tl.arange(0, BLOCK_TAIL).to(tl.int64)[None, None, :]
        tail_mask = row_ok & (tail < head_dim)
        tl.store(y_head + tail * stride_yd, tl.load(x_head + tail * stride_xd, mask=tail_mask), mask=tail_mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    seq_len, n_heads_q, n_heads_k, half, head_dim,
    stride_qb, stride_qs, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_qob, stride_qos, stride_qoh, stride_qod, stride_kob, stride_kos, stride_koh, stride_kod,
    stride_cb, stride_cs, stride_cd, stride_nb, stride_ns, stride_nd,
    BACKWARD: tl.constexpr, COPY_TAIL: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Program (p, g, b) owns positions [p * BLOCK_S, (p + 1) * BLOCK_S) of batch row b and BLOCK_H heads
    # there: head group g of q when g < cdiv(Hq, BLOCK_H), else head group g - cdiv(Hq, BLOCK_H) of k
    # (strides are given in [B, S, H, D] order whatever the layout). No loop: it reads its [BLOCK_S,
    # BLOCK_H, D] tile once and writes it once, BLOCK_H * D elements per position each way out of place
    # (the tail d >= R copied when COPY_TAIL), BLOCK_H * R in place (q_out is q, k_out k). Per position
    # it reads R cos and R sin values, reused by its BLOCK_H heads; every head group re-reads them, which
    # is L2 traffic (R cos + R sin values per position per head group), not extra DRAM traffic.
    b = tl.program_id(2).to(tl.int64)
    group = tl.program_id(1)
    s = (tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S))[:, None, None]
    s_ok = s < seq_len
    d = tl.arange(0, BLOCK_HALF).to(tl.int64)[None, None, :]
    mask = s_ok & (d < half)
    cos_pos, sin_pos = cos_ptr + b * stride_cb + s * stride_cs, sin_ptr + b * stride_nb + s * stride_ns
    # every head group of every batch row re-reads these rows: ask L2 to keep them (evict_last)
    c1 = tl.load(cos_pos + d * stride_cd, mask=mask, eviction_policy="evict_last").to(tl.float32)
    c2 = tl.load(cos_pos + (d + half) * stride_cd, mask=mask, eviction_policy="evict_last").to(tl.float32)
    n1 = tl.load(sin_pos + d * stride_nd, mask=mask, eviction_policy="evict_last").to(tl.float32)
    n2 = tl.load(sin_pos + (d + half) * stride_nd, mask=mask, eviction_policy="evict_last").to(tl.float32)
    if BACKWARD:  # the transposed rotation: dx1 = dy1*c1 + dy2*n2, dx2 = dy2*c2 - dy1*n1
        n1, n2 = -n2, -n1
    head_block = tl.arange(0, BLOCK_H).to(tl.int64)[None, :, None]
    q_groups = tl.cdiv(n_heads_q, BLOCK_H)
    if group < q_groups:
        _rotate_heads(q_ptr, q_out_ptr, b, s, s_ok, group * BLOCK_H + head_block, d, c1, c2, n1, n2, n_heads_q,
                      half, head_dim, stride_qb, stride_qs, stride_qh, stride_qd,
                      stride_qob, stride_qos, stride_qoh, stride_qod, COPY_TAIL, BLOCK_TAIL)
    else:
        _rotate_heads(k_ptr, k_out_ptr, b, s, s_ok, (group - q_groups) * BLOCK_H + head_block, d, c1, c2, n1, n2,
                      n_heads_k, half, head_dim, stride_kb, stride_ks, stride_kh, stride_kd,
                      stride_kob, stride_kos, stride_koh, stride_kod, COPY_TAIL, BLOCK_TAIL)


_TUNE_KEY = ["n_heads_q", "n_heads_k", "half", "head_dim", "BACKWARD", "COPY_TAIL"]
_PRUNE = {"early_config_prune": _prune_by_registers}
_rope_out_of_place = autotune(_CONFIGS, key=_TUNE_KEY, prune_configs_by=_PRUNE)(_rope_kernel)
# Tuning runs the kernel repeatedly: the in-place launcher restores q and k after each trial.
_rope_in_place = autotune(_CONFIGS, key=_TUNE_KEY, prune_configs_by=_PRUNE, restore_value=["q_ptr", "k_ptr"])(
    _rope_kernel)


# ----------------------------------------------------------------------------------- launchers
def _bshd_strides(x: Tensor, layout: str) -> tuple[int, int, int, int]:
    sb, s1, s2, sd = x.stride()
    return (sb, s2, s1, sd) if layout == "bhsd" else (sb, s1, s2, sd)


def _bshd_shape(x: Tensor, layout: str) -> tuple[int, int, int, int]:
    b, n1, n2, d = x.shape
    return (b, n2, n1, d) if layout == "bhsd" else (b, n1, n2, d)


def _from_bshd(x: Tensor, layout: str) -> Tensor:
    return x.transpose(1, 2) if layout == "bhsd" else x


def _new_output_for(x: Tensor, layout: str) -> Tensor:
    """Output for x: in x's memory order when x is dense (reads and writes then walk memory alike),
    else [B, S, H, D] in memory (e.g. for q sliced out of a packed qkv), viewed in x's layout."""
    out = new_output_like(x)  # empty_like keeps x's strides exactly when x is dense
    if out.stride() == x.stride():
        return out
    return _from_bshd(new_output(_bshd_shape(x, layout), x.dtype, x.device), layout)


def _cos_sin_strides(t: Tensor) -> tuple[int, int, int]:
    return (0 if t.shape[0] == 1 else t.stride(0), t.stride(1), t.stride(2))


def _launch(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_out: Tensor, k_out: Tensor, layout: str,
            backward: bool) -> None:
    batch, seq_len, n_heads_q, head_dim = _bshd_shape(q, layout)
    n_heads_k = _bshd_shape(k, layout)[2]
    half = cos.shape[-1] // 2
    if batch == 0 or seq_len == 0:
        return
    in_place = q_out is q
    copy_tail = not in_place and 2 * half < head_dim
    kernel = _rope_in_place if in_place else _rope_out_of_place
    grid = lambda meta: (triton.cdiv(seq_len, meta["BLOCK_S"]),  # noqa: E731
                         triton.cdiv(n_heads_q, meta["BLOCK_H"]) + triton.cdiv(n_heads_k, meta["BLOCK_H"]), batch)
    kernel[grid](
        q, k, cos, sin, q_out, k_out, seq_len, n_heads_q, n_heads_k, half, head_dim,
        *_bshd_strides(q, layout), *_bshd_strides(k, layout),
        *_bshd_strides(q_out, layout), *_bshd_strides(k_out, layout),
        *_cos_sin_strides(cos), *_cos_sin_strides(sin),
        BACKWARD=backward, COPY_TAIL=copy_tail, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_TAIL=triton.next_power_of_2(max(head_dim - 2 * half, 1)),
    )


def _launch_out_of_place(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str,
                         backward: bool) -> tuple[Tensor, Tensor]:
    q_out, k_out = _new_output_for(q, layout), _new_output_for(k, layout)
    _launch(q, k, cos, sin, q_out, k_out, layout, backward)
    return q_out, k_out


# ----------------------------------------------------------------------------------- registration
def _rope_impl(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    return _launch_out_of_place(q, k, cos, sin, layout, backward=False)


def _rope_backward_impl(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    return _launch_out_of_place(dq, dk, cos, sin, layout, backward=True)


def _rope_inplace_impl(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str) -> None:
    _launch(q, k, cos, sin, q, k, layout, backward=False)


def _fake_output_for(x: Tensor, layout: str) -> Tensor:  # the strides _new_output_for gives
    out = torch.empty_like(x, memory_format=torch.preserve_format)
    if out.stride() == x.stride():
        return out
    return _from_bshd(x.new_empty(_bshd_shape(x, layout)), layout)


def _rope_fake(q, k, cos, sin, layout):
    return _fake_output_for(q, layout), _fake_output_for(k, layout)


def _rope_inplace_fake(q, k, cos, sin, layout):
    return None


def _setup_rope(ctx, inputs, output):
    _, _, cos, sin, layout = inputs
    ctx.save_for_backward(cos, sin)
    ctx.layout = layout


def _backward_rope(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq_in, dk_in = ROPE_BACKWARD(dq, dk, cos, sin, ctx.layout)
    return dq_in, dk_in, None, None, None


ROPE_BACKWARD = FusedOp("rope_backward", _rope_backward_impl, fake=_rope_fake)
ROPE = FusedOp("rope", _rope_impl, fake=_rope_fake, setup_context=_setup_rope, backward=_backward_rope)
ROPE_INPLACE = FusedOp("rope_", _rope_inplace_impl, fake=_rope_inplace_fake, mutates_args=("q", "k"))


# ----------------------------------------------------------------------------------- public API
def _check_rope_args(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, layout: str) -> None:
    check_tensor("q", q, rank=4)
    check_tensor("k", k, rank=4)
    check_tensor("cos", cos, rank=3)
    check_tensor("sin", sin, rank=3)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    check_same("q", q, k=k)
    check_same_device("q", q, cos=cos, sin=sin)
    if sin.dtype != cos.dtype:
        raise TypeError(f"sin has dtype {sin.dtype} but cos has dtype {cos.dtype}")
    batch, seq_len, _, head_dim = _bshd_shape(q, layout)
    k_batch, k_seq_len, _, k_head_dim = _bshd_shape(k, layout)
    if (k_batch, k_seq_len, k_head_dim) != (batch, seq_len, head_dim):
        raise ValueError(f"k has shape {tuple(k.shape)} but q has shape {tuple(q.shape)} (layout {layout!r}): "
                         "batch, sequence length and head_dim must match")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape[0] not in (1, batch):
            raise ValueError(f"{name} has batch size {table.shape[0]} but q has batch size {batch} "
                             f"({name}'s batch must be 1 or {batch})")
        if table.shape[1] != seq_len:
            raise ValueError(f"{name} has sequence length {table.shape[1]} but q has sequence length {seq_len}")
    rotary_dim = cos.shape[-1]
    if sin.shape[-1] != rotary_dim:
        raise ValueError(f"sin has shape {tuple(sin.shape)} but cos has shape {tuple(cos.shape)}: last dims differ")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"cos's last dim (rotary_dim) must be even and in [2, head_dim={head_dim}], got {rotary_dim}")


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, layout: str = "bhsd",
         inplace: bool = False) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of q and k (HF's ``apply_rotary_pos_emb``, rotate_half convention).

    Args:
        q: [B, Hq, S, D] for ``layout="bhsd"`` (HF's layout after transpose) or [B, S, Hq, D] for
            ``"bshd"``; fp32/fp16/bf16 (any float dtype on the reference path); any strides.
        k: as q with Hk heads (Hk may differ from Hq: GQA); same dtype and device as q.
        cos, sin: [1 or B, S, R] (each batch 1 or B), R = rotary_dim even and <= D; any float dtype
            (e.g. fp32 with bf16 q), same device as q. Elements d >= R of every head pass through unchanged
            (partial rotary).
        layout: ``"bhsd"`` or ``"bshd"``.
        inplace: rotate q and k in place and return them (inference / KV-cache writes; q and k must not
            overlap). Not allowed while grad mode is on and q or k requires grad.

    Returns:
        (q_rotated, k_rotated) in q's dtype and layout, computed in fp32. Out of place, each output has
        its input's memory order when the input is dense, else [B, S, H, D] order in memory.
    """
    _check_rope_args(q, k, cos, sin, layout)
    grad_on = torch.is_grad_enabled()
    if inplace and grad_on and (q.requires_grad or k.requires_grad):
        raise ValueError("inplace=True is not allowed when q or k requires grad (grad mode is on); "
                         "use inplace=False or torch.no_grad()")
    use_triton = runs_triton(q) and not (grad_on and (cos.requires_grad or sin.requires_grad))
    if inplace:
        if use_triton:
            ROPE_INPLACE(q, k, cos, sin, layout)
        else:
            q_rotated, k_rotated = rope_reference(q, k, cos, sin, layout)
            q.copy_(q_rotated)
            k.copy_(k_rotated)
        return q, k
    if use_triton:
        return ROPE(q, k, cos, sin, layout)
    return rope_reference(q, k, cos, sin, layout)

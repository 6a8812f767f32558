import contextlib
import inspect
from typing import NamedTuple

import pytest
import torch

import fuselm
from fuselm.ops import attention
from fuselm.ops._common import counters
from tests.conftest import DEVICE
from tests.helpers import assert_close, randn

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class Case(NamedTuple):
    heads: int
    kv_heads: int
    queries: int  # T
    head_dim: int
    cache_len: int  # L
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    softcap: float = 0.0
    window: int = 0
    splits: int = 1  # what _num_splits returns (the interpreter's one SM would give 1)


# The interpreter runs the first config, 32 positions per tile; spans are cut into whole tiles.
CASES = {
    # MHA; a full row cut into 4 splits (combined by the last), a left-padded row in 3
    "ratio1-many-splits-left-pad": Case(4, 4, 1, 64, 100, (0, 5), (100, 90), splits=4),
    # GQA 4: length 1; exactly one split's worth (32 positions, one tile); the full buffer in 2 splits
    "ratio4-len1-one-split-full": Case(8, 2, 1, 128, 40, (0, 0, 0), (1, 32, 40), splits=4),
    # GQA 8, T = 3, soft-capping, a head_dim that is not a power of 2
    "ratio8-T3-softcap-d80": Case(8, 1, 3, 80, 37, (2, 0), (37, 9), softcap=30.0, splits=2),
    # window shorter than the context, crossing splits; T = 3
    "window-short-T3-d96": Case(4, 1, 3, 96, 100, (0, 4), (100, 90), window=70, splits=3),
    # window longer than the context; head_dim 256 with 16 rows (GQA 8, T = 2), whose combine merges 4 partials
    # a step: 7 splits, 2 steps
    "window-long-d256": Case(8, 1, 2, 256, 200, (3,), (200,), window=300, splits=8),
    # 64 rows (GQA 8, T = 8) at head_dim 256: 2 row blocks of 32 per kv head
    "row-blocks-d256": Case(16, 2, 8, 256, 40, (0, 5), (40, 33), splits=2),
    # one split
    "one-split": Case(4, 2, 1, 64, 50, (0, 2), (50, 45)),
    # rows with no visible position (ends == starts, ends < starts) next to a full one
    "empty-rows": Case(4, 2, 1, 64, 24, (0, 10, 5), (24, 10, 3), splits=2),
    # rows shorter than T: query 0 sits before the row's start (at -1; at 13 < 14) and sees nothing
    "T3-rows-shorter-than-T": Case(4, 2, 3, 64, 16, (0, 14), (2, 16), softcap=5.0, splits=2),
    # splits of several tiles, a left-padded row whose start is not on a tile boundary, and a partial last tile
    "decode-many-tiles": Case(8, 2, 1, 128, 300, (0, 37), (300, 290), splits=2),
    # T = 3 with a window: a split's first tiles are partly outside some rows' windows; a row ending on a tile
    # boundary, whose last tile holds positions only the later queries see
    "window-many-tiles-T3": Case(4, 1, 3, 64, 300, (0, 7, 0), (300, 260, 64), window=150, splits=2),
}


@contextlib.contextmanager
def splits(count: int):
    """decode_attention launches ``count`` splits (the interpreter's single 'SM' would pick 1)."""
    chosen = attention._num_splits
    attention._num_splits = lambda *static_shapes: count
    try:
        yield
    finally:
        attention._num_splits = chosen


def read_span(start: int, end: int, queries: int, window: int, cache_len: int) -> tuple[int, int]:
    """Positions [lo, hi) some query of the row sees: all a kernel may read."""
    lo = max(start, end - queries - window + 1) if window else start
    return max(lo, 0), min(end, cache_len)


def float64_oracle(q, k_cache, v_cache, starts, ends, scale, softcap=0.0, window=0):
    """Row by row, query by query, over exactly the positions each query sees, in float64."""
    batch, heads, queries, head_dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(batch, heads, queries, head_dim, dtype=torch.float64)
    for b in range(batch):
        start, end = int(starts[b]), int(ends[b])
        for t in range(queries):
            pos = end - queries + t
            lo = max(start, pos - window + 1) if window else start
            if lo > pos:
                continue  # nothing visible: zeros
            keys = k_cache[b, :, lo:pos + 1].double().cpu().repeat_interleave(group, dim=0)  # [Hq, n, D]
            values = v_cache[b, :, lo:pos + 1].double().cpu().repeat_interleave(group, dim=0)
            logits = torch.einsum("hd,hnd->hn", q[b, :, t].double().cpu(), keys) * scale
            if softcap:
                logits = softcap * torch.tanh(logits / softcap)
            out[b, :, t] = torch.einsum("hn,hnd->hd", torch.softmax(logits, dim=-1), values)
    return out


def make_inputs(case: Case, dtype, device=DEVICE):
    """Random q and caches; every cache position no query sees is NaN, so reading one shows."""
    batch = len(case.starts)
    q = randn(batch, case.heads, case.queries, case.head_dim, dtype=dtype, device=device)
    caches = []
    for _ in range(2):
        cache = randn(batch, case.kv_heads, case.cache_len, case.head_dim, dtype=dtype, device=device)
        for b, (start, end) in enumerate(zip(case.starts, case.ends)):
            lo, hi = read_span(start, end, case.queries, case.window, case.cache_len)
            cache[b, :, :lo] = float("nan")
            cache[b, :, max(hi, lo):] = float("nan")
        caches.append(cache)
    starts = torch.tensor(case.starts, dtype=torch.int32, device=device)
    ends = torch.tensor(case.ends, dtype=torch.int32, device=device)
    return q, *caches, starts, ends


def check_case(case: Case, dtype, q=None, k_cache=None, v_cache=None):
    inputs = list(make_inputs(case, dtype))
    for i, given in enumerate((q, k_cache, v_cache)):
        if given is not None:
            inputs[i] = given
    q, k_cache, v_cache, starts, ends = inputs
    with splits(case.splits):
        out = fuselm.decode_attention(q, k_cache, v_cache, starts, ends, softcap=case.softcap, window=case.window)
    expected = float64_oracle(q, k_cache, v_cache, starts, ends, case.head_dim ** -0.5, case.softcap, case.window)
    assert out.dtype == dtype and out.shape == q.shape and out.transpose(1, 2).is_contiguous()
    assert_close(out, expected, dtype)
    return out, expected


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64(path, case, dtype):
    out, expected = check_case(case, dtype)
    sees_nothing = expected.abs().sum(-1) == 0
    assert (out.cpu()[sees_nothing] == 0).all()  # exact zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(path, dtype):
    """q as HF has it before the transpose ([B, T, Hq, D] memory) with padded rows, caches in [B, L, Hkv, D]
    memory: strides are read, nothing is copied."""
    case = Case(8, 2, 3, 64, 70, (0, 6), (70, 41), softcap=20.0, window=50, splits=3)
    q, k_cache, v_cache, _, _ = make_inputs(case, dtype)
    q_wide = randn(2, 3, 8, 80, dtype=dtype, device=DEVICE)
    q_wide[..., :64] = q.transpose(1, 2)
    q = q_wide[..., :64].transpose(1, 2)
    k_cache, v_cache = (c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k_cache, v_cache))
    assert not q.is_contiguous() and not k_cache.is_contiguous()
    check_case(case, dtype, q, k_cache, v_cache)


def test_strided_and_expanded_lengths(path):
    """starts/ends as the columns of one [B, 2] tensor (stride 2), and one value expanded to every row (stride 0)."""
    case = CASES["ratio1-many-splits-left-pad"]
    q, k_cache, v_cache, starts, ends = make_inputs(case, torch.float32)
    bounds = torch.stack([starts, ends], dim=1)
    with splits(case.splits):
        out = fuselm.decode_attention(q, k_cache, v_cache, bounds[:, 0], bounds[:, 1])
        assert_close(out, float64_oracle(q, k_cache, v_cache, starts, ends, 64 ** -0.5), torch.float32)
        one_end = torch.tensor([70], dtype=ends.dtype).expand(2)
        one_start = torch.tensor([5], dtype=starts.dtype).expand(2)  # inside both rows: NaN lies outside them
        out = fuselm.decode_attention(q, k_cache, v_cache, one_start, one_end)
    assert_close(out, float64_oracle(q, k_cache, v_cache, one_start.contiguous(), one_end.contiguous(), 64 ** -0.5),
                 torch.float32)


def test_int64_lengths_and_explicit_scale(path):
    case = CASES["ratio1-many-splits-left-pad"]
    q, k_cache, v_cache, starts, ends = make_inputs(case, torch.float32)
    with splits(case.splits):
        out = fuselm.decode_attention(q, k_cache, v_cache, starts.long(), ends.long(), scale=0.3)
    assert_close(out, float64_oracle(q, k_cache, v_cache, starts, ends, 0.3), torch.float32)


def test_counters_are_zero_after_each_launch():
    case = CASES["ratio1-many-splits-left-pad"]
    q, k_cache, v_cache, starts, ends = make_inputs(case, torch.float32)
    with fuselm.use_backend("triton"), splits(case.splits):
        first = fuselm.decode_attention(q, k_cache, v_cache, starts, ends)
        assert not any(tickets.any() for tickets in counters[q.device])
        second = fuselm.decode_attention(q, k_cache, v_cache, starts, ends)
    assert torch.equal(first, second)


def test_the_split_count_depends_on_static_shapes_only():
    assert list(inspect.signature(attention._num_splits).parameters) == [
        "batch", "n_kv_heads", "row_blocks", "cache_len", "sms", "merge_width"]
    llama_batch1 = attention._num_splits(1, 8, 1, 32768, 132, 64)
    assert llama_batch1 * 8 >= 132  # B = 1: enough splits to give every SM a program
    assert attention._num_splits(32, 8, 1, 4096, 132, 32) == 1  # B = 32: the batch fills the GPU already
    assert attention._num_splits(8, 8, 1, 4096, 132, 32) == 5  # 64 units: about two programs per SM
    assert attention._num_splits(1, 8, 1, 768, 132, 32) == 768 // attention.MIN_SPLIT_POSITIONS  # short: by L
    assert attention._num_splits(1, 8, 1, attention.MIN_SPLIT_POSITIONS, 132, 32) == 1  # a short buffer is not cut up
    assert attention._num_splits(1, 1, 1, 10**6, 10**4, 128) == attention.MAX_SPLITS


def test_a_split_count_just_past_the_merge_width_is_rounded_down_to_it():
    """33 splits (132 SMs, 8 kv heads) merge in two steps whenever 33 chunks are active; 32 merge in one."""
    assert attention._num_splits(1, 8, 1, 32768, 132, 64) == 33  # under the width: one step either way
    assert attention._num_splits(1, 8, 1, 32768, 132, 32) == 32  # Llama-3-8B, GQA 4 x D 128
    assert attention._num_splits(1, 8, 1, 32768, 132, 16) == 32  # GQA 8 x D 128: 3 steps -> 2
    assert attention._num_splits(1, 8, 1, 32768, 132, 8) == 32  # 5 steps -> 4
    # more than an eighth of the splits past the width: kept (the programs are worth more than a merge step)
    assert attention._num_splits(1, 6, 1, 32768, 132, 32) == 44  # 12 past 32, above 44 // 8 = 5
    assert attention._num_splits(1, 8, 1, 32768, 132, 20) == 33  # 13 past 20


@pytest.mark.parametrize("window", [0, 5, 100])
def test_matches_hf_gemma2_eager_attention(path, window):
    """HF's own mask functions (sliding window, causal, left padding) and Gemma 2's eager attention (soft-cap
    after the scale) agree with decode_attention for a T = 3 step over a left-padded batch."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    case = Case(8, 2, 3, 64, 40, (0, 6), (40, 31), softcap=20.0, window=window)
    q, k_cache, v_cache, starts, ends = (t.nan_to_num() for t in make_inputs(case, torch.float32))
    mask_function = sliding_window_causal_mask_function(window) if window else causal_mask_function
    kv_idx = torch.arange(case.cache_len)[None, :]
    masks = [mask_function(b, 0, int(ends[b]) - 3 + torch.arange(3)[:, None], kv_idx) & (kv_idx >= int(starts[b]))
             for b in range(2)]
    additive = torch.where(torch.stack(masks)[:, None], 0.0, torch.finfo(torch.float32).min).to(DEVICE)
    module = type("Attention", (), {"num_key_value_groups": 4, "training": False})()
    expected, _ = eager_attention_forward(module, q, k_cache, v_cache, additive, scaling=0.125, softcap=20.0)
    out = fuselm.decode_attention(q, k_cache, v_cache, starts, ends, scale=0.125, softcap=20.0, window=window)
    assert_close(out.transpose(1, 2), expected, torch.float32)


def test_configs_that_overflow_shared_memory_are_pruned():
    k_bf16, k_fp32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1, dtype=torch.float32)
    for k_ptr, block_d in ((k_bf16, 128), (k_bf16, 256), (k_fp32, 128)):
        kept = attention._prune_by_shared_memory(attention._CONFIGS, {"k_ptr": k_ptr}, BLOCK_D=block_d)
        assert kept and all(c.num_stages * c.kwargs["BLOCK_N"] * 2 * block_d * k_ptr.element_size()
                            <= attention.SHARED_MEMORY_BUDGET for c in kept)
    assert len(attention._prune_by_shared_memory(attention._CONFIGS, {"k_ptr": k_bf16}, BLOCK_D=128)) == len(
        attention._CONFIGS)  # Llama's head_dim in bf16 keeps them all


def test_reference_zeroes_garbage_outside_the_rows(path):
    """An uninitialised cache (NaN, inf) outside the visible positions never reaches the output."""
    case = CASES["empty-rows"]
    q, k_cache, v_cache, starts, ends = make_inputs(case, torch.float32)
    k_cache, v_cache = k_cache.nan_to_num(nan=float("inf")), v_cache.nan_to_num(nan=-float("inf"))
    check_case(case, torch.float32, q, k_cache, v_cache)


def test_gradient_runs_the_reference():
    case = CASES["ratio8-T3-softcap-d80"]
    q, k_cache, v_cache, starts, ends = make_inputs(case, torch.float32)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    q.requires_grad_()
    with fuselm.use_backend("triton"):
        out = fuselm.decode_attention(q, k_cache, v_cache, starts, ends, softcap=case.softcap)
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(dq).all() and dq.abs().sum() > 0


def test_empty_batch_and_empty_cache(path):
    q = randn(0, 4, 1, 64, device=DEVICE)
    k_cache = randn(0, 2, 8, 64, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    assert fuselm.decode_attention(q, k_cache, k_cache, empty, empty).shape == (0, 4, 1, 64)
    q, k_cache = randn(2, 4, 1, 64, device=DEVICE), randn(2, 2, 0, 64, device=DEVICE)
    zero = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    assert torch.equal(fuselm.decode_attention(q, k_cache, k_cache, zero, zero), torch.zeros_like(q))


def test_triton_path_appears_in_profile():
    q, k_cache, v_cache, starts, ends = make_inputs(CASES["one-split"], torch.float32)
    with fuselm.use_backend("triton"), torch.profiler.profile() as prof:
        fuselm.decode_attention(q, k_cache, v_cache, starts, ends)
    assert "fuselm::decode_attention" in {e.key for e in prof.key_averages()}


def test_compiles_without_graph_breaks():
    case = CASES["ratio4-len1-one-split-full"]
    q, k_cache, v_cache, starts, ends = make_inputs(case, torch.float32)

    def step(q, k_cache, v_cache, starts, ends):
        return fuselm.decode_attention(q, k_cache, v_cache, starts, ends, softcap=10.0)

    with fuselm.use_backend("triton"):
        eager = step(q, k_cache, v_cache, starts, ends)
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_cache, v_cache, starts, ends)
    assert torch.equal(compiled, eager)


BAD_INPUTS = [  # (how the arguments change, the exception, what its message names)
    ({"k_cache": lambda t: t.double()}, TypeError, "k_cache"),
    ({"v_cache": lambda t: t.half()}, TypeError, "v_cache"),
    ({"k_cache": lambda t: t.to("meta")}, ValueError, "k_cache"),
    ({"starts": lambda t: t.float()}, TypeError, "starts"),
    ({"ends": lambda t: t.to(torch.int16)}, TypeError, "ends"),
    ({"ends": lambda t: t[:1]}, ValueError, "ends"),
    ({"starts": lambda t: t[:, None]}, ValueError, "starts"),
    ({"starts": lambda t: t.tolist()}, TypeError, "starts"),
    ({"q": lambda t: t[:, :3]}, ValueError, "heads"),  # 3 q heads over 2 kv heads
    ({"q": lambda t: t[..., :48], "k_cache": lambda t: t[..., :48], "v_cache": lambda t: t[..., :48]}, ValueError,
     "head_dim"),
    ({"v_cache": lambda t: t[:, :, :5]}, ValueError, "v_cache"),
    ({"k_cache": lambda t: t[:1]}, ValueError, "k_cache"),
    ({"q": lambda t: t.expand(-1, -1, 17, -1)}, ValueError, "queries"),
    ({"q": lambda t: t.int()}, TypeError, "q"),
    ({"softcap": lambda _: -1.0}, ValueError, "softcap"),
    ({"softcap": lambda _: None}, TypeError, "softcap"),  # HF configs hold None where soft-capping is off
    ({"window": lambda _: 2.5}, ValueError, "window"),
]


@pytest.mark.parametrize(("changes", "error", "named"), BAD_INPUTS, ids=[f"{n}-{i}" for i, (_, _, n) in
                                                                         enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(path, changes, error, named):
    q, k_cache, v_cache, starts, ends = make_inputs(Case(4, 2, 1, 64, 8, (0, 0), (8, 8)), torch.float32)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "starts": starts, "ends": ends, "softcap": 0.0,
            "window": 0}
    args.update({name: change(args[name]) for name, change in changes.items()})
    with pytest.raises(error, match=named):
        fuselm.decode_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("starts"),
                                args.pop("ends"), **args)


def check_every_path():
    """The kernel's code paths in two launches (test_configs runs this under every autotune config): bf16 GQA 8
    with T = 2 and soft-capping, cut into up to 10 splits and combined (8 a step: 2 steps at 32 or 64 positions a tile),
    next to a left-padded row; fp32 GQA 3 with T = 3 and a window across splits, next to an empty row."""
    check_case(Case(16, 2, 2, 128, 600, (0, 7), (600, 150), softcap=30.0, splits=10), torch.bfloat16)
    check_case(Case(6, 2, 3, 64, 200, (0, 9), (200, 9), window=90, splits=2), torch.float32)


# ----------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_rows_on_gpu(dtype):
    """Llama-3-8B's heads at a few thousand positions, the split count the GPU's SM count gives."""
    case = Case(32, 8, 1, 128, 4096, (0, 100, 0, 4000), (4096, 3000, 1, 4001))
    q, k_cache, v_cache, starts, ends = make_inputs(case, dtype, "cuda")
    with fuselm.use_backend("triton"):
        out = fuselm.decode_attention(q, k_cache, v_cache, starts, ends)
    assert_close(out, float64_oracle(q, k_cache, v_cache, starts, ends, 128 ** -0.5), dtype)


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_lengths():
    """One call captured in a CUDA graph; new starts/ends written into the same tensors between replays."""
    case = Case(16, 4, 3, 128, 2048, (0, 0, 0), (2048, 2048, 2048), softcap=50.0, window=1500)
    q, k_cache, v_cache, starts, ends = make_inputs(case, torch.bfloat16, "cuda")
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()  # new lengths read other positions

    def step():
        return fuselm.decode_attention(q, k_cache, v_cache, starts, ends, softcap=50.0, window=1500)

    with fuselm.use_backend("triton"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compilation and autotuning, outside the capture
            step()
        torch.cuda.current_stream().wait_stream(side)
        tuned = dict(attention._decode_attention.cache)  # autotuner keys: static shapes only
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for new_starts, new_ends in [((0, 0, 0), (2048, 2048, 2048)), ((5, 0, 700), (1000, 3, 2048)),
                                     ((0, 10, 0), (1, 10, 1600))]:
            starts.copy_(torch.tensor(new_starts))
            ends.copy_(torch.tensor(new_ends))
            graph.replay()
            torch.cuda.synchronize()
            eager = step()
            assert torch.equal(captured, eager)
            expected = float64_oracle(q, k_cache, v_cache, starts, ends, 128 ** -0.5, 50.0, 1500)
            assert_close(captured, expected, torch.bfloat16)
        assert attention._decode_attention.cache == tuned  # new lengths never re-tuned

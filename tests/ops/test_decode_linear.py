"""linear_residual, norm_gated_linear and qkv_rope against float64 references (interpreter on CPU, GPU).

Rows M = 1, 3 and 17 take the weight-streaming kernels (the norm in their prologue; fp16 runs it first), M = 80
the cuBLAS path (plain torch matmul on CPU); tests that monkeypatch the dispatch thresholds cover the rest of each
path. x rows have different RMS, so each row's rstd is checked. Outputs and the KV caches start as NaN: a cache
keeps NaN everywhere except at the positions each row writes."""

import contextlib
import json
from unittest import mock

import pytest
import torch
from triton.runtime.errors import OutOfResources

import fuselm
from fuselm.ops import decode_linear
from fuselm.ops._common import TUNING_DIR, _key_text, counters, forced_config, launch_key
from fuselm.ops.decode_linear import linear_residual_reference, norm_gated_linear_reference, qkv_rope_reference
from tests.conftest import DEVICE
from tests.helpers import assert_close
from tests.helpers import randn as randn_on

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 3, 17, 80]  # 80 > MAX_STREAMING_ROWS: the cuBLAS path


def randn(*shape, dtype=torch.float32, scale=1.0):
    return randn_on(*shape, dtype=dtype, device=DEVICE, scale=scale)


def _double(t):
    return None if t is None else t.double()


def _row_scaled(x):
    """x [..., K] with each row times its own factor in [0.5, 4): rows of different RMS, so a norm that misses or
    mixes up a row's rstd fails."""
    factors = 0.5 + 3.5 * torch.rand(*x.shape[:-1], 1, device=x.device)
    return (x.float() * factors).to(x.dtype)


def _rows_input(n_rows, n_inner, dtype, contiguous=True):
    """x [n_rows, n_inner], rows of different RMS; non-contiguous: every other column of a wider tensor."""
    if contiguous:
        return _row_scaled(randn(n_rows, n_inner, dtype=dtype))
    return _row_scaled(randn(n_rows, 2 * n_inner, dtype=dtype))[:, ::2]


# ----------------------------------------------------------------------------------- linear_residual
def _check_linear_residual(n_rows, dtype, has_bias, contiguous=True, leading=(), n_inner=40, n_out=24):
    x = _rows_input(n_rows, n_inner, dtype, contiguous)
    if leading:
        x = x.reshape(*leading, -1, n_inner)
    weight = randn(n_out, n_inner, dtype=dtype, scale=0.2)
    residual = randn(*x.shape[:-1], n_out, dtype=dtype)
    bias = randn(n_out, dtype=dtype) if has_bias else None
    residual_before = residual.clone()
    with torch.no_grad():
        out = fuselm.linear_residual(x, weight, residual, bias)
    expected = linear_residual_reference(x.double(), weight.double(), residual.double(), _double(bias))
    assert out.dtype == dtype and out.shape == residual.shape
    assert torch.equal(residual, residual_before)  # the caller's residual is not modified
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("n_rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_linear_residual_matches_float64(path, n_rows, dtype, has_bias):
    _check_linear_residual(n_rows, dtype, has_bias)


def test_linear_residual_non_contiguous_and_leading_dims(path):
    _check_linear_residual(3, torch.bfloat16, True, contiguous=False)
    _check_linear_residual(6, torch.float32, False, leading=(2,))


@pytest.mark.parametrize(("n_rows", "streams"), [
    (17, True),  # M <= LINEAR_RESIDUAL_MAX_ROWS: the streaming kernel
    (33, False),  # M past LINEAR_RESIDUAL_MAX_ROWS (but <= MAX_STREAMING_ROWS): cuBLAS addmm
])
@pytest.mark.parametrize("has_bias", [False, True])
def test_linear_residual_takes_the_kernel_only_where_it_beats_cublas(monkeypatch, n_rows, streams, has_bias):
    calls = []
    kernel_op = decode_linear.LINEAR_RESIDUAL
    monkeypatch.setattr(decode_linear, "LINEAR_RESIDUAL", lambda *args: calls.append(args) or kernel_op(*args))
    with fuselm.use_backend("triton"):
        _check_linear_residual(n_rows, torch.bfloat16, has_bias)
    assert len(calls) == int(streams)


SPLIT_K_CONFIGS = [i for i, c in enumerate(decode_linear._linear_residual_kernel.configs) if c.kwargs["SPLIT_K"] > 1]


@pytest.mark.parametrize("config", SPLIT_K_CONFIGS)
def test_linear_residual_split_k_sums_every_chunk_once(config):
    """K = 1100 over BLOCK_K-multiple chunks: 2 to 5 chunks with values, a short last one, an empty one for
    SPLIT_K = 4 at BLOCK_K = 256 (chunk 512). The last program per column block combines them; its ticket is
    back at zero after each launch, and two launches agree bit for bit (the partials are summed in split order)."""
    torch.manual_seed(config)
    with fuselm.use_backend("triton"), forced_config(decode_linear._linear_residual_kernel, config):
        for dtype in (torch.float32, torch.bfloat16):
            _check_linear_residual(3, dtype, True, n_inner=1100)
            x, weight, residual = randn(2, 1100), randn(24, 1100, scale=0.1), randn(2, 24)
            with torch.no_grad():
                first = fuselm.linear_residual(x, weight, residual)
                assert not any(tickets.any() for tickets in counters[x.device])
                assert torch.equal(first, fuselm.linear_residual(x, weight, residual))


def test_linear_residual_keeps_autograd():
    x = randn(3, 40).requires_grad_()
    weight, residual = randn(24, 40).requires_grad_(), randn(3, 24)
    with fuselm.use_backend("triton"):
        out = fuselm.linear_residual(x, weight, residual)
    out.sum().backward()
    assert_close(weight.grad, torch.ones(3, 24, dtype=torch.float64).T @ x.double().cpu(), torch.float32)


# ----------------------------------------------------------------------------------- norm_gated_linear
def _check_norm_gated(n_rows, dtype, activation="silu", packed=False, norm="llama", contiguous=True, n_inner=40,
                      n_out=24):
    x = _rows_input(n_rows, n_inner, dtype, contiguous)
    norm_weight = None if norm is None else 1 + 0.1 * randn(n_inner, dtype=dtype)
    casting, offset = ("gemma", 1.0) if norm == "gemma" else ("llama", 0.0)
    gate_up = randn(2 * n_out, n_inner, dtype=dtype, scale=0.3)
    weights = (gate_up, None) if packed else (gate_up[:n_out].clone(), gate_up[n_out:].clone())
    with torch.no_grad():
        out = fuselm.norm_gated_linear(x, norm_weight, 1e-5, *weights, activation=activation, casting=casting,
                                       offset=offset)
    expected = norm_gated_linear_reference(x.double(), _double(norm_weight), 1e-5, *map(_double, weights), activation,
                                           casting, offset)
    assert out.dtype == dtype and out.shape == (n_rows, n_out)
    assert_close(out, expected, dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # interpreter: exp(large) = inf
@pytest.mark.parametrize("n_rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_norm_gated_linear_matches_float64(path, n_rows, dtype, activation):
    _check_norm_gated(n_rows, dtype, activation)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("n_rows", [3, 17, 80])
@pytest.mark.parametrize(("packed", "norm"), [(True, "llama"), (False, "gemma"), (True, None), (False, None)])
def test_norm_gated_linear_layouts_and_norms(path, n_rows, packed, norm):
    _check_norm_gated(n_rows, torch.bfloat16, "gelu_tanh" if norm == "gemma" else "silu", packed, norm)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("n_rows", [1, 32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("norm", "n_inner"), [("llama", 40), ("gemma", 72)])
def test_norm_gated_linear_with_a_constant_offset(monkeypatch, n_rows, dtype, norm, n_inner):
    """CONSTANT_OFFSET (FUSELM_CONSTANT_OFFSET=1): the prologue norm's offset compiled in as a constant matches
    float64, as the run-time offset does (Llama's 0, Gemma's 1; K = 40, 72: a partial last tile)."""
    monkeypatch.setattr(decode_linear, "CONSTANT_OFFSET", True)
    with fuselm.use_backend("triton"):
        _check_norm_gated(n_rows, dtype, norm=norm, n_inner=n_inner)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("casting", "head_norm"), [("llama", False), ("gemma", True)])
def test_qkv_rope_with_a_constant_offset(monkeypatch, dtype, casting, head_norm):
    """CONSTANT_OFFSET in qkv_rope's prologue norm (the split and whole-head kernels) against float64."""
    monkeypatch.setattr(decode_linear, "CONSTANT_OFFSET", True)
    with fuselm.use_backend("triton"):
        _check_qkv(2, 1, dtype, casting=casting, head_norm=head_norm, hidden=72)


@pytest.mark.parametrize("op", ["norm_gated_linear", "qkv_rope"])
def test_the_constant_offset_is_the_one_the_kernels_add(monkeypatch, op):
    """A constant one more than the offset moves the Triton kernels' result away from float64 (so the constant, not
    the run-time offset, reaches the norm), and the switch off passes None (the run-time offset)."""
    monkeypatch.setattr(decode_linear, "CONSTANT_OFFSET", False)
    assert decode_linear._constant_offset(1.0) is None
    monkeypatch.setattr(decode_linear, "CONSTANT_OFFSET", True)
    assert decode_linear._constant_offset(1.0) == 1.0
    monkeypatch.setattr(decode_linear, "_constant_offset", lambda offset: offset + 1.0)
    with fuselm.use_backend("triton"), pytest.raises(AssertionError):
        if op == "norm_gated_linear":
            _check_norm_gated(1, torch.float32, norm="gemma")
        else:
            _check_qkv(2, 1, torch.float32, casting="gemma")


@contextlib.contextmanager
def _streaming_at_every_m():
    """The streaming kernels, the prologue norm included, up to MAX_STREAMING_ROWS rows whatever the thresholds."""
    every_m = decode_linear.MAX_STREAMING_ROWS
    with mock.patch.multiple(decode_linear, LINEAR_RESIDUAL_MAX_ROWS=every_m,
                             GATED_PROLOGUE_NORM_MAX_ROWS=every_m, QKV_PROLOGUE_NORM_MAX_ROWS=every_m):
        yield


PROLOGUE_CASES = {  # (rows, *_PROLOGUE_NORM_MAX_ROWS, dtype): the norm in the prologue or run first
    "norm_first": (5, 4, torch.float32),
    "prologue_block_16": (5, 64, torch.float32),
    "prologue_block_16_full": (16, 64, torch.bfloat16),
    "prologue_block_64": (33, 64, torch.bfloat16),
    "fp16_norm_first": (5, 64, torch.float16),  # x * weight before the rstd could leave fp16's range
}


@pytest.mark.parametrize("case", PROLOGUE_CASES)
def test_norm_in_prologue_and_norm_first_agree(monkeypatch, case):
    """Both sides of *_PROLOGUE_NORM_MAX_ROWS (and fp16, always norm first): the prologue norm and fuselm.rms_norm
    first, each checked to be the path taken."""
    n_rows, prologue_max_rows, dtype = PROLOGUE_CASES[case]
    monkeypatch.setattr(decode_linear, "GATED_PROLOGUE_NORM_MAX_ROWS", prologue_max_rows)
    monkeypatch.setattr(decode_linear, "QKV_PROLOGUE_NORM_MAX_ROWS", prologue_max_rows)
    norms_first, rms_norm = [], decode_linear.rms_norm
    monkeypatch.setattr(decode_linear, "rms_norm", lambda *args: norms_first.append(args[0].shape) or rms_norm(*args))
    with fuselm.use_backend("triton"):
        _check_norm_gated(n_rows, dtype, norm="gemma", contiguous=False)
        _check_qkv(1, n_rows, dtype)
    in_prologue = n_rows <= prologue_max_rows and dtype != torch.float16
    assert len(norms_first) == (0 if in_prologue else 2)


# ----------------------------------------------------------------------------------- shipped tuning tables
class _LaunchRecorder:
    """Stands in for tuned kernel ``name``: ``kernel[grid](*args, **kwargs)`` records the launch's key as triton's
    autotuner files it (launch_key)."""

    def __init__(self, name):
        self.name, self.tuner, self.keys = name, getattr(decode_linear, name), []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            key = launch_key(self.tuner, frozenset(self.tuner.arg_names), args, kwargs)
            self.keys.append((self.name, _key_text(key)))
        return launch


@pytest.mark.parametrize("table", ["nvidia-h200.json", "nvidia-h100-80gb-hbm3.json"])
@pytest.mark.parametrize("n_rows", [1, 32])
def test_decode_projection_launches_key_into_the_shipped_tables(monkeypatch, table, n_rows):
    """The o, down and gate/up launches of a Llama-3-8B decode step (bf16) file keys the GPU's shipped table holds
    (launch_key, as triton's autotuner builds them): a launcher that adds or reorders a tensor argument without
    migrating the tables fails here, not on the GPU as run-time tuning (session 37)."""
    picks = {(p["kernel"], json.dumps(p["key"])) for p in json.loads((TUNING_DIR / table).read_text())["picks"]}
    recorders = [_LaunchRecorder("_linear_residual_kernel"), _LaunchRecorder("_norm_gated_kernel")]
    for recorder in recorders:
        monkeypatch.setattr(decode_linear, recorder.name, recorder)
    monkeypatch.setattr(decode_linear, "dependent_launch", lambda *args, **kwargs: {})
    hidden, intermediate, bf16 = 4096, 14336, torch.bfloat16
    x, residual, norm_weight = (torch.empty(*shape, dtype=bf16) for shape in ((n_rows, hidden),) * 2 + ((hidden,),))
    o_weight, up_weight = torch.empty(hidden, hidden, dtype=bf16), torch.empty(intermediate, hidden, dtype=bf16)
    decode_linear._linear_residual_impl(x, o_weight, residual, None)
    decode_linear._linear_residual_impl(torch.empty(n_rows, intermediate, dtype=bf16),
                                        torch.empty(hidden, intermediate, dtype=bf16), residual, None)  # down
    decode_linear._norm_gated_linear_impl(x, norm_weight, 1e-5, up_weight, up_weight, "silu", 0.0)
    launched = [key for recorder in recorders for key in recorder.keys]
    assert len(launched) == 3
    assert [key for key in launched if key not in picks] == []


# ----------------------------------------------------------------------------------- qkv_rope
def _qkv_inputs(batch, seq_len, dtype, num_heads=3, num_kv_heads=1, head_dim=16, rotary_dim=None, packed=False,
                bias=False, head_norm=False, casting="llama", shared_positions=False, cos_batch=1, cache_len=None,
                strided=False, hidden=40, outside=False):
    """(args, options) of a qkv_rope call; caches NaN. strided: x, cos and sin every other element of wider
    tensors, caches [B, L, Hkv, D] in memory (viewed as [B, Hkv, L, D]). outside: each row's first position -1 and
    its last L (to be written nowhere)."""
    rotary_dim = rotary_dim or head_dim
    cache_len = cache_len or seq_len + 5
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    weight = randn(q_size + 2 * kv_size, hidden, dtype=dtype, scale=2 / hidden**0.5)
    bias_all = randn(q_size + 2 * kv_size, dtype=dtype) if bias else None
    if packed:
        weights, biases = (weight, None, None), {"q_bias": bias_all}
    else:
        weights = tuple(w.clone() for w in weight.split([q_size, kv_size, kv_size]))
        biases = dict(zip(("q_bias", "k_bias", "v_bias"), bias_all.split([q_size, kv_size, kv_size]))) if bias else {}
    positions = torch.stack([torch.randperm(cache_len, device=DEVICE)[:seq_len] for _ in range(batch)]) if batch else (
        torch.zeros(0, seq_len, dtype=torch.long, device=DEVICE))
    if outside:
        positions[:, 0], positions[:, -1] = -1, cache_len
    if shared_positions:
        positions = positions[0].int()
    angles = randn(cos_batch, seq_len, 2 * rotary_dim, scale=3.0)[..., ::2] if strided else randn(
        cos_batch, seq_len, rotary_dim, scale=3.0)
    cache_shape = (batch, cache_len, num_kv_heads, head_dim) if strided else (batch, num_kv_heads, cache_len, head_dim)
    cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
    if strided:
        cache = cache.transpose(1, 2)
    x = _row_scaled(randn(batch, seq_len, 2 * hidden if strided else hidden, dtype=dtype))
    if strided:
        x = x[..., ::2]
    options = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, **biases, "casting": casting,
               "offset": 1.0 if casting == "gemma" else 0.0}
    if head_norm:
        options |= {"q_norm_weight": 1 + 0.1 * randn(head_dim), "k_norm_weight": 1 + 0.1 * randn(head_dim),
                    "qk_norm_eps": 1e-5}
    args = [x, 1 + 0.1 * randn(hidden, dtype=dtype), 1e-6, *weights,
            angles.cos(), angles.sin(), cache, cache.clone(), positions]
    return args, options


def _check_qkv(batch, seq_len, dtype, last_only=False, **variant):
    args, options = _qkv_inputs(batch, seq_len, dtype, **variant)
    args64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    options64 = {k: _double(v) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    expected = qkv_rope_reference(*args64, **options64, last_only=last_only)
    with torch.no_grad():
        q = fuselm.qkv_rope(*args, **options, last_only=last_only)
    assert q.dtype == dtype and q.shape == expected.shape and q.transpose(1, 2).is_contiguous()  # [B, T, Hq, D]
    assert_close(q, expected, dtype, "q")
    for name, cache, cache64 in (("k_cache", args[8], args64[8]), ("v_cache", args[9], args64[9])):
        written = ~cache64.isnan()
        assert torch.equal(~cache.isnan(), written), f"{name}: written elements differ from the reference's"
        assert_close(cache[written], cache64[written], dtype, name)


@pytest.mark.parametrize(("batch", "seq_len"), [(1, 1), (3, 1), (1, 17), (2, 40)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_rope_matches_float64(path, batch, seq_len, dtype):
    _check_qkv(batch, seq_len, dtype)


QKV_VARIANTS = {
    "packed": {"packed": True},
    "bias": {"bias": True},
    "packed_bias_partial": {"packed": True, "bias": True, "head_dim": 32, "rotary_dim": 20},
    "head_norm": {"head_norm": True},
    "head_norm_gemma_partial": {"head_norm": True, "casting": "gemma", "rotary_dim": 12},
    "gqa_shared_positions": {"num_heads": 4, "num_kv_heads": 2, "shared_positions": True, "cos_batch": 2},
}


@pytest.mark.parametrize("variant", QKV_VARIANTS)
@pytest.mark.parametrize(("batch", "seq_len"), [(2, 1), (1, 17), (2, 40)])
def test_qkv_rope_variants(path, variant, batch, seq_len):
    options = QKV_VARIANTS[variant]
    if options.get("cos_batch") and batch == 1:
        options = {**options, "cos_batch": 1}
    _check_qkv(batch, seq_len, torch.bfloat16, **options)


@pytest.mark.parametrize("variant", ["plain", "packed_bias_partial", "head_norm", "gqa_shared_positions"])
@pytest.mark.parametrize(("batch", "seq_len"), [(2, 3), (2, 40), (3, 31)])
def test_qkv_rope_last_only(path, variant, batch, seq_len):
    """q of each row's last position alone, [B, Hq, 1, D], with every position's k and v written: 6 rows slice the
    streaming kernel's q; 80 and 93 rows run q's GEMM for the B last rows and the epilogue for q heads only in the
    programs that hold a last row (93: last rows 30, 61, 92 fall at different offsets in the row blocks)."""
    options = {} if variant == "plain" else QKV_VARIANTS[variant]
    if "cos_batch" in options:
        options = {**options, "cos_batch": batch}
    _check_qkv(batch, seq_len, torch.bfloat16, last_only=True, **options)
    _check_qkv(batch, seq_len, torch.float32, last_only=True, **options)


@pytest.mark.parametrize(("batch", "seq_len"), [(1, 2), (2, 40)])
def test_qkv_rope_positions_outside_the_cache_write_nothing(path, batch, seq_len):
    _check_qkv(batch, seq_len, torch.float32, outside=True)


@pytest.mark.parametrize(("batch", "seq_len"), [(2, 3), (2, 40)])
def test_qkv_rope_strided_input_and_cache(path, batch, seq_len):
    _check_qkv(batch, seq_len, torch.float32, strided=True, head_norm=True)


WHOLE_TILE_CASES = [(kernel, i) for kernel in (decode_linear._linear_residual_kernel, decode_linear._norm_gated_kernel,
                                               decode_linear._qkv_rope_split) for i in range(len(kernel.configs))]


def _in_dtypes_that_fit(dtypes, check, first_only=False) -> list:
    """``check(dtype)`` for each of ``dtypes`` (or up to the first that runs, with ``first_only``); the dtypes it ran
    in. On a GPU, a forced config that needs more shared memory than the GPU has raises ``OutOfResources`` at launch
    (fp32 doubles a bf16 tile's bytes); triton's autotuner times such a config as inf and never picks it, so that
    dtype is left out, and the test skips when none fits. The interpreter has no such limit: there it raises."""
    ran = []
    for dtype in dtypes:
        try:
            check(dtype)
        except OutOfResources:
            if DEVICE == "cpu":
                raise
            continue
        ran.append(dtype)
        if first_only:
            break
    if not ran:
        pytest.skip(f"the forced config needs more shared memory than this GPU has in each of {dtypes}")
    return ran


@pytest.mark.parametrize(("kernel", "config"), WHOLE_TILE_CASES,
                         ids=[f"{k.fn.__name__ if hasattr(k, 'fn') else k}-{i}" for k, i in WHOLE_TILE_CASES])
def test_whole_tiles_load_without_masks(kernel, config):
    """Every config at sizes its tiles divide (K = 1024, N = 128, whole rotary halves), where the streaming loops
    load without masks (EVEN_K, EVEN_N, FULL_HALF), against float64; M = 3 rows still masked to BLOCK_M."""
    assert decode_linear._whole_tiles(decode_linear._LINEAR_RESIDUAL_CONFIGS, 1024, 128) == {"EVEN_K": True,
                                                                                             "EVEN_N": True}
    assert decode_linear._whole_tiles(decode_linear._STREAMING_CONFIGS, 256, 128) == {"EVEN_K": True, "EVEN_N": True}
    assert decode_linear._even_k(decode_linear._QKV_CONFIGS, 1024)
    # the other tests' odd sizes (K = 40 or 1100, N = 24) keep the masked loads
    assert decode_linear._whole_tiles(decode_linear._LINEAR_RESIDUAL_CONFIGS, 1100, 24) == {"EVEN_K": False,
                                                                                            "EVEN_N": False}
    assert not decode_linear._even_k(decode_linear._QKV_CONFIGS, 40)
    torch.manual_seed(config)
    with fuselm.use_backend("triton"), forced_config(kernel, config):
        if kernel is decode_linear._linear_residual_kernel:
            _check_linear_residual(3, torch.float32, True, n_inner=1024, n_out=128)
        elif kernel is decode_linear._norm_gated_kernel:
            _check_norm_gated(3, torch.float32, n_inner=256, n_out=128)
        else:
            _in_dtypes_that_fit((torch.float32, torch.bfloat16), first_only=True,
                                check=lambda dtype: _check_qkv(3, 1, dtype, num_heads=2, head_dim=128, hidden=1024))


# ----------------------------------------------------------------------------------- bad input
def _call_qkv(**changes):
    args, options = _qkv_inputs(2, 3, torch.float32)
    names = ["x", "norm_weight", "eps", "q_weight", "k_weight", "v_weight", "cos", "sin", "k_cache", "v_cache",
             "cache_positions"]
    named = dict(zip(names, args)) | options
    # each bad input on the test device, but for the one meant to be on another device (meta)
    named.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
                  for k, v in changes.items()})
    fuselm.qkv_rope(*[named.pop(n) for n in names], **named)


QKV_SPLIT_K_CONFIGS = [(kernel, i) for kernel in (decode_linear._qkv_rope_split, decode_linear._qkv_rope_whole)
                       for i, c in enumerate(kernel.configs) if c.kwargs["SPLIT_K"] > 1]


@pytest.mark.parametrize(("kernel", "config"), QKV_SPLIT_K_CONFIGS,
                         ids=[f"{'whole' if k is decode_linear._qkv_rope_whole else 'split'}-{i}"
                              for k, i in QKV_SPLIT_K_CONFIGS])
def test_qkv_rope_split_k_sums_every_chunk_once(kernel, config):
    """hidden = 1100 over SPLIT_K chunks (one short, one empty at SPLIT_K = 4): the last program of each head part
    sums the partials, then bias, head norm (the whole-head kernel), RoPE with a pass-through tail and the cache
    write run once; tickets are zero after each launch and a second launch gives the same bits."""
    torch.manual_seed(config)
    head_norm = kernel is decode_linear._qkv_rope_whole
    with fuselm.use_backend("triton"), forced_config(kernel, config):
        dtype = _in_dtypes_that_fit((torch.float32, torch.bfloat16), check=lambda dtype: _check_qkv(
            1, 3, dtype, head_dim=128, rotary_dim=96, bias=True, head_norm=head_norm, hidden=1100))[-1]
        args, options = _qkv_inputs(2, 1, dtype, head_dim=128, head_norm=head_norm, hidden=1100)
        with torch.no_grad():
            first = fuselm.qkv_rope(*args, **options)
            assert not any(tickets.any() for tickets in counters[first.device])
            assert torch.equal(first, fuselm.qkv_rope(*args, **options))


@pytest.mark.parametrize(("changes", "error", "match"), [
    ({"k_cache": torch.zeros(2, 1, 8, 16, dtype=torch.bfloat16)}, TypeError, "k_cache"),
    ({"v_cache": torch.zeros(2, 1, 8, 16, device="meta")}, ValueError, "v_cache"),
    ({"cache_positions": torch.zeros(2, 3)}, TypeError, "cache_positions"),
    ({"cache_positions": torch.zeros(3, 2, dtype=torch.long)}, ValueError, "cache_positions"),
    ({"num_heads": 3, "num_kv_heads": 2}, ValueError, "num_kv_heads"),
    ({"q_weight": torch.zeros(40, 40)}, ValueError, "q_weight"),
    ({"k_weight": torch.zeros(16, 41)}, ValueError, "k_weight"),
    ({"v_weight": None}, ValueError, "v_weight"),
    ({"k_bias": torch.zeros(16)}, ValueError, "q_bias"),
    ({"q_norm_weight": torch.ones(16)}, ValueError, "k_norm_weight"),
    ({"cos": torch.zeros(1, 3, 18), "sin": torch.zeros(1, 3, 18)}, ValueError, "rotary_dim"),
    ({"sin": torch.zeros(1, 4, 16)}, ValueError, "sin"),
    ({"casting": "phi"}, ValueError, "casting"),
    ({"x": torch.zeros(6, 40)}, ValueError, "x"),
    ({"eps": -1.0}, ValueError, "eps"),
    ({"eps": None}, TypeError, "eps"),
    ({"offset": float("inf")}, ValueError, "offset"),
    ({"q_norm_weight": torch.ones(16), "k_norm_weight": torch.ones(16), "qk_norm_eps": -1e-6}, ValueError,
     "qk_norm_eps"),
])
def test_qkv_rope_bad_input(changes, error, match):
    with pytest.raises(error, match=match):
        _call_qkv(**changes)


def test_projection_bad_input():
    x, w = randn(3, 40), randn(24, 40)
    with pytest.raises(ValueError, match="residual"):
        fuselm.linear_residual(x, w, randn(3, 25))
    with pytest.raises(TypeError, match="weight"):
        fuselm.linear_residual(x, w.half(), randn(3, 24))
    with pytest.raises(ValueError, match="bias"):
        fuselm.linear_residual(x, w, randn(3, 24), randn(23))
    with pytest.raises(ValueError, match="up_weight"):
        fuselm.norm_gated_linear(x, None, 1e-6, w, randn(23, 40))
    with pytest.raises(ValueError, match="gate_weight"):
        fuselm.norm_gated_linear(x, None, 1e-6, randn(23, 40))
    with pytest.raises(ValueError, match="norm_weight"):
        fuselm.norm_gated_linear(x, randn(39), 1e-6, w, w)
    with pytest.raises(ValueError, match="activation"):
        fuselm.norm_gated_linear(x, None, 1e-6, w, w, activation="relu")
    with pytest.raises(ValueError, match="eps"):
        fuselm.norm_gated_linear(x, randn(40), -1.0, w, w)
    with pytest.raises(TypeError, match="eps"):
        fuselm.norm_gated_linear(x, randn(40), "1e-6", w, w)
    with pytest.raises(ValueError, match="offset"):
        fuselm.norm_gated_linear(x, randn(40), 1e-6, w, w, offset=float("nan"))


def test_qkv_epilogue_refuses_q_rows_of_neither_kind():
    """The large-M epilogue takes q of every row (M) or of each sequence's last (B); any other count is an error."""
    rows, seq_len = 6, 3
    q, k, v = randn(4, 16), randn(rows, 16), randn(rows, 16)
    cos = sin = randn(1, seq_len, 16)
    caches = [randn(2, 1, seq_len, 16) for _ in range(2)]
    with pytest.raises(ValueError, match="q has 4 rows"):
        decode_linear.QKV_EPILOGUE(q, k, v, None, None, 1e-6, cos, sin, *caches,
                                   torch.arange(seq_len, device=DEVICE), 1, seq_len, "llama", 0.0)


def test_zero_width_projections(path):
    """K = 0: the residual (x @ W.T is zeros); N = 0 or I = 0: an empty [..., 0], as F.linear gives."""
    residual = randn(3, 4)
    assert torch.equal(fuselm.linear_residual(randn(3, 0), randn(4, 0), residual), residual)
    assert fuselm.linear_residual(randn(2, 3, 8), randn(0, 8), randn(2, 3, 0)).shape == (2, 3, 0)
    assert fuselm.norm_gated_linear(randn(3, 8), randn(8), 1e-6, randn(0, 8), randn(0, 8)).shape == (3, 0)


def test_empty_rows(path):
    x = randn(0, 40)
    assert fuselm.linear_residual(x, randn(24, 40), randn(0, 24)).shape == (0, 24)
    assert fuselm.norm_gated_linear(x, randn(40), 1e-6, randn(24, 40), randn(24, 40)).shape == (0, 24)
    args, options = _qkv_inputs(0, 3, torch.float32)
    assert fuselm.qkv_rope(*args, **options).shape == (0, 3, 3, 16)


# ----------------------------------------------------------------------------------- every autotune config
# The forced-config checks use shapes every config fits on an H200 (shared memory: fp32 only where a config's
# tiles are small enough; the autotuner skips the configs that do not fit a shape, a forced config cannot).
def _check_streaming_configs():
    # BLOCK_M 16, 32, 64; the norm in the prologue (bf16) or run first (fp16); at 40 the dispatch thresholds are
    # lifted so both kernels run (and compile) at BLOCK_M 64
    for n_rows, dtype in ((3, torch.float32), (17, torch.bfloat16), (40, torch.float16)):
        with _streaming_at_every_m() if n_rows == 40 else contextlib.nullcontext():
            _check_linear_residual(n_rows, dtype, True)
            _check_norm_gated(n_rows, torch.bfloat16 if dtype == torch.float32 else dtype, "silu", packed=n_rows == 3)


def _check_qkv_configs(head_norm):
    # head_dim 128 (64 pairs, 32 tail columns with rotary_dim 96): every SPLIT keeps tl.dot tiles >= 16
    for rotary_dim, dtype in ((128, torch.float16), (96, torch.bfloat16)):
        _check_qkv(1, 3, dtype, head_dim=128, rotary_dim=rotary_dim, bias=True, head_norm=head_norm)


DECODE_CONFIG_CHECKS = [  # (name, the kernel whose configs are forced, a check that runs it)
    ("linear_residual", decode_linear._linear_residual_kernel, _check_streaming_configs),
    ("norm_gated", decode_linear._norm_gated_kernel, _check_streaming_configs),
    ("qkv_rope_split", decode_linear._qkv_rope_split, lambda: _check_qkv_configs(False)),
    ("qkv_rope_whole", decode_linear._qkv_rope_whole, lambda: _check_qkv_configs(True)),
    ("qkv_epilogue", decode_linear._qkv_epilogue_kernel,
     lambda: _check_qkv(2, 40, torch.float32, head_norm=True, rotary_dim=10, packed=True)),
]


# ----------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_qkv_rope_decode_step_replays_in_a_cuda_graph():
    """One captured call, replayed with new x and new positions: q and the caches match eager calls."""
    args, options = _qkv_inputs(4, 1, torch.bfloat16, num_heads=8, num_kv_heads=2, head_dim=64, cache_len=32)
    static_x, static_positions = args[0], args[10]
    with torch.no_grad():
        fuselm.qkv_rope(*args, **options)  # warm-up: compiles and autotunes
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_q = fuselm.qkv_rope(*args, **options)
        for _ in range(3):
            static_x.copy_(randn(*static_x.shape, dtype=torch.bfloat16))
            static_positions.copy_(torch.randint(0, 32, static_positions.shape, device=DEVICE))
            eager_caches = [args[8].clone(), args[9].clone()]
            eager_q = fuselm.qkv_rope(*args[:8], *eager_caches, static_positions, **options)
            graph.replay()
            torch.testing.assert_close(static_q, eager_q, rtol=0, atol=0)
            torch.testing.assert_close(args[8], eager_caches[0], rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(args[9], eager_caches[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows", [1, 8, 17, 64, 65])
def test_llama_sized_projections_match_float64(n_rows):
    """Real model widths (hidden 4096, heads of 128) through the GPU kernels: long K loops, many programs, the
    autotuner's pick among the configs."""
    x, residual = _row_scaled(randn(n_rows, 4096, dtype=torch.bfloat16)), randn(n_rows, 1024, dtype=torch.bfloat16)
    weight, norm_weight = randn(1024, 4096, dtype=torch.bfloat16, scale=0.02), 1 + 0.1 * randn(4096)
    with torch.no_grad():
        out = fuselm.linear_residual(x, weight, residual)
        gated = fuselm.norm_gated_linear(x, norm_weight.bfloat16(), 1e-5, weight, weight.flip(0))
    assert_close(out, linear_residual_reference(x.double(), weight.double(), residual.double()), torch.bfloat16)
    expected = norm_gated_linear_reference(x.double(), norm_weight.bfloat16().double(), 1e-5, weight.double(),
                                           weight.flip(0).double())
    assert_close(gated, expected, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows", [1, 8, 64, 65])
@pytest.mark.parametrize("variant", [{}, {"head_norm": True}, {"packed": True, "rotary_dim": 96, "bias": True}])
def test_llama_sized_qkv_rope_matches_float64(n_rows, variant):
    _check_qkv(n_rows, 1, torch.bfloat16, num_heads=32, num_kv_heads=8, head_dim=128, cache_len=80, hidden=4096,
               **variant)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, {"head_norm": True}, {"packed": True, "rotary_dim": 96, "bias": True}])
def test_llama_sized_qkv_rope_last_only_matches_float64(variant):
    """A prefill's last layer at real widths: q's GEMM for the 3 last rows of 3 x 257, and the q heads in only the
    epilogue programs that hold one (the last rows fall at different offsets of the autotuner's row blocks)."""
    _check_qkv(3, 257, torch.bfloat16, last_only=True, num_heads=32, num_kv_heads=8, head_dim=128, hidden=4096,
               **variant)


def test_torch_compile_traces_the_fused_ops_without_graph_breaks():
    """Under torch.compile the ops are fuselm:: custom ops (fake impls for tracing; qkv_rope's cache writes
    functionalised): no graph break, the same results as eager and the same cache writes."""
    x, weight, residual = randn(3, 40), randn(24, 40, scale=0.3), randn(3, 24)
    norm_weight, up = 1 + 0.1 * randn(40), randn(24, 40, scale=0.3)
    args, options = _qkv_inputs(3, 1, torch.float32)

    def step(x, weight, residual, norm_weight, up, qkv_args):
        out = fuselm.linear_residual(x, weight, residual)
        gated = fuselm.norm_gated_linear(x, norm_weight, 1e-6, weight, up)
        return out, gated, fuselm.qkv_rope(*qkv_args, **options)

    compiled_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with fuselm.use_backend("triton"), torch.no_grad():
        eager = step(x, weight, residual, norm_weight, up, args)
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x, weight, residual, norm_weight, up,
                                                                            compiled_args)
        explained = torch._dynamo.explain(step)(x, weight, residual, norm_weight, up, [
            a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    assert explained.graph_break_count == 0
    for got, expected in zip(compiled, eager):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for got, expected in zip(compiled_args[8:10], args[8:10]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)

"""``fuselm profile``: what a model launches per decoder layer and phase, unpatched and patched, under torch.profiler.

For each phase (``prefill``: one forward of the prompt; ``decode``: one-token forwards over a KV cache; ``train``:
forward + backward with the causal-LM loss) the model runs unpatched, then patched by :func:`fuselm.patch`, each
at its full ``layers`` and cut to its first ``layers // 2`` (the same weights). Warm-up steps (compilation,
autotuning) run first, outside the profiler; then ``steps`` steps are profiled and every figure is per step.

- **Launches per decoder layer** = (launches at L layers − launches at K layers) / (L − K): what each layer adds,
  whatever the embedding, the final norm, the lm_head and the loss launch (``outside layers`` = the rest). In
  models whose layers alternate kinds (sliding and full attention), both counts should hold every kind (e.g.
  ``--layers 4`` for Gemma 2), else the difference also takes in the work HF does once per kind (masks, RoPE).
- **GPU time by op kind**: each kernel's time, per step at L layers, by the kind of op that launched it
  (its name, or the torch op it was launched from): projections (GEMM/GEMV, fused projection kernels),
  attention, norms (fused or ``aten`` norm ops; an unfused norm's pow/mean/rsqrt/mul count as elementwise),
  elementwise (activations, RoPE, adds, casts, copies, reductions), loss, other (memcpy/memset).
- **Idle share**: of the GPU window from the first kernel's start to the last kernel's end, the part in which no
  kernel ran (the GPU waiting for the host to launch).
- **Bound**: decode counts bytes (every weight read once per step, plus each layer's KV cache read and its new
  position written) against the copy bandwidth, prefill and train count FLOPs (the projections, causal attention,
  the lm_head; train ≈ 3 × forward) against a bf16 GEMM, both measured in the same run; the formula is printed.

While the profiler records, fuselm's ops go through ``torch.library``'s dispatch (so the profile names them
``fuselm::<op>``), which costs host time the unprofiled patched model does not spend: the patched model's idle
share here is an upper bound.

Without CUDA there are no device events: the run says so and counts, on the CPU, the ops that would each launch a
kernel on a GPU (innermost ``aten`` ops that compute, not views or allocations), and each Triton launch (in
Triton's interpreter, ``TRITON_INTERPRET=1``) as one.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import inspect
import json
import re
import statistics
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import fuselm
from fuselm.backend import INTERPRETING, path_name

PHASES = ("prefill", "decode", "train")
KINDS = ("projections", "attention", "norms", "elementwise", "loss", "other")
WARMUP_STEPS = 2


@dataclass(frozen=True)
class KnownModel:
    """A config from the built-in table: its HF ``model_type`` and the published config's sizes (random weights)."""

    model_type: str
    source: str  # the Hugging Face model whose config.json these values are from
    config: dict = field(default_factory=dict)


MODELS: dict[str, KnownModel] = {
    "llama-3-8b": KnownModel("llama", "meta-llama/Meta-Llama-3-8B", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)),
    "llama-3.1-8b": KnownModel("llama", "meta-llama/Llama-3.1-8B", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "mistral-7b": KnownModel("mistral", "mistralai/Mistral-7B-v0.3", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=32768,
        sliding_window=None)),
    "qwen2.5-7b": KnownModel("qwen2", "Qwen/Qwen2.5-7B", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=False)),
    "qwen3-8b": KnownModel("qwen3", "Qwen/Qwen3-8B", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960,
        tie_word_embeddings=False)),
    "gemma-2-9b": KnownModel("gemma2", "google/gemma-2-9b", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rms_norm_eps=1e-6, rope_theta=10000.0,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, tie_word_embeddings=True)),
    "phi-3-mini": KnownModel("phi3", "microsoft/Phi-3-mini-4k-instruct", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
        sliding_window=2047, tie_word_embeddings=False)),
}

_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


class ArgumentError(ValueError):
    """A bad argument to :func:`run` (the CLI prints it as its one-line error)."""


def resolve(model: str):
    """The HF config of ``model`` (a built-in name or a local model directory) and the directory to load weights
    from (None: random weights). Raises ArgumentError with a one-line message."""
    from transformers import AutoConfig

    if model in MODELS:
        known = MODELS[model]
        return AutoConfig.for_model(known.model_type, **known.config), None
    path = Path(model)
    if not path.is_dir():
        raise ArgumentError(f"unknown model {model!r}: give a local Hugging Face model directory or one of "
                         f"{', '.join(MODELS)}")
    if not (path / "config.json").is_file():
        raise ArgumentError(f"{model!r} has no config.json: not a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError) as error:
        raise ArgumentError(f"{model!r}: transformers cannot read its config.json ({error})".splitlines()[0]) from None
    has_weights = any(any(path.glob(pattern)) for pattern in _WEIGHT_FILES)
    return config, (path if has_weights else None)


def build(config, weights: Path | None, layers: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` at its first ``layers`` decoder layers, in eval mode: random weights, or the
    checkpoint in ``weights`` (its later layers are not loaded)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    if weights is not None:
        model = AutoModelForCausalLM.from_pretrained(weights, config=config, dtype=dtype).to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@contextlib.contextmanager
def first_layers(model: nn.Module, count: int) -> Iterator[None]:
    """The model cut to its first ``count`` decoder layers inside the block (the same modules and weights)."""
    decoder, config = model.get_decoder(), model.config
    layers, saved = decoder.layers, (config.num_hidden_layers, getattr(config, "layer_types", None))
    decoder.layers = nn.ModuleList(list(layers)[:count])
    config.num_hidden_layers = count
    if isinstance(saved[1], list):
        config.layer_types = saved[1][:count]
    try:
        yield
    finally:
        decoder.layers = layers
        config.num_hidden_layers = saved[0]
        if isinstance(saved[1], list):
            config.layer_types = saved[1]


# ------------------------------------------------------------------------------------------- what launched
_ATTENTION = ("flash", "fmha", "attention", "sdpa", "attn")
_GEMM = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "splitk", "_linear_residual", "_norm_gated", "_qkv_")
_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::mv",
             "aten::addmv", "aten::_addmm_activation", "fuselm::qkv_rope", "fuselm::norm_gated_linear",
             "fuselm::linear_residual"}
_LOSS = ("cross_entropy", "nll_loss", "log_softmax")
_NORM = re.compile(r"(rms|layer|group|batch)_?norm")
# ops that launch no kernel on a GPU: views, metadata, allocations, no-op conversions (an aten::to that converts
# has an aten::copy_ below it, which counts)
NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "view", "view_as", "as_strided", "reshape", "_reshape_alias", "_unsafe_view", "transpose", "t", "permute",
    "expand", "expand_as", "unsqueeze", "squeeze", "slice", "select", "narrow", "split", "split_with_sizes", "chunk",
    "unbind", "flatten", "unflatten", "alias", "detach", "detach_", "lift_fresh", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_", "resolve_conj", "resolve_neg",
    "promote_types", "result_type", "to", "_to_copy", "type_as", "contiguous", "clone", "size", "stride", "dim",
    "numel", "is_nonzero", "item", "movedim", "swapaxes", "_has_compatible_shallow_copy_type", "requires_grad_",
    "zeros_like", "ones_like", "zeros", "ones", "full", "new_zeros", "new_ones", "new_full"))


def classify(kernel: str, op: str) -> str:
    """The kind (one of KINDS) of a kernel named ``kernel``, launched from the torch op named ``op``."""
    k, o = kernel.lower(), op.lower()
    if any(word in k for word in _ATTENTION):
        return "attention"
    if any(word in k for word in _GEMM):
        return "projections"
    if any(word in k or word in o for word in _LOSS):
        return "loss"
    if o in _GEMM_OPS:
        return "projections"
    if any(word in o for word in _ATTENTION):
        return "attention"
    if _NORM.search(k) or _NORM.search(o):
        return "norms"
    if k.startswith(("memcpy", "memset", "aten::_local_scalar_dense")):
        return "other"
    return "elementwise"


@dataclass(frozen=True)
class Launch:
    """One kernel (or, on the CPU, one op that would launch one): its name, kind and, on a GPU, its time span."""

    name: str
    kind: str
    start_us: float = 0.0
    end_us: float = 0.0


def _fused_op(event) -> str | None:
    while event is not None:
        if event.name.startswith("fuselm::"):
            return event.name
        event = event.cpu_parent
    return None


def device_launches(events) -> list[Launch]:
    """Every kernel, memcpy and memset of a CUDA profile, with the kind of the torch op it was launched from."""
    # torch ops (no link of their own); a kernel's linked id is its op's id (the CUDA runtime's CPU-side events,
    # cudaLaunchKernel & co., carry a link and ids from another counter)
    ops = {event.id: event for event in events
           if event.device_type == DeviceType.CPU and not getattr(event, "linked_correlation_id", 0)}
    launches = []
    for event in events:
        if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        op = ops.get(getattr(event, "linked_correlation_id", 0))
        launcher = (_fused_op(op) or op.name) if op is not None else ""
        launches.append(Launch(event.name, classify(event.name, launcher), event.time_range.start,
                               event.time_range.end))
    return launches


def host_launches(events) -> list[Launch]:
    """On the CPU: each innermost computing ``aten`` op (what launches a kernel on a GPU) and each Triton launch
    (``triton::<kernel>`` ranges, see :func:`_named_interpreter_launches`), with its kind."""
    launches: list[Launch] = []

    def visit(event, fused: str | None) -> bool:  # whether this event or one below it counts
        name = event.name
        if name.startswith("triton::"):
            launches.append(Launch(name, classify(name.removeprefix("triton::"), fused or "")))
            return True
        fused = fused or (name if name.startswith("fuselm::") else None)
        below = False
        for child in event.cpu_children:
            below = visit(child, fused) or below
        if not below and name.startswith("aten::") and name not in NO_KERNEL:
            launches.append(Launch(name, classify(name, fused or name)))
            return True
        return below

    for event in events:
        if event.device_type == DeviceType.CPU and event.cpu_parent is None:
            visit(event, None)
    return launches


@contextlib.contextmanager
def _named_interpreter_launches() -> Iterator[None]:
    """In Triton's interpreter, a profiler range ``triton::<kernel>`` around each launch: the interpreter runs a
    kernel on the host, as no event of its own, so a CPU profile could not count it otherwise."""
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:
        yield
        return
    launch = GridExecutor.__call__

    def named(self, *args, **kwargs):
        with record_function(f"triton::{getattr(self.fn, '__name__', 'kernel')}"):
            return launch(self, *args, **kwargs)

    GridExecutor.__call__ = named
    try:
        yield
    finally:
        GridExecutor.__call__ = launch


def busy_and_window_us(launches: list[Launch]) -> tuple[float, float]:
    """(time in which at least one kernel ran, first start to last end), in µs."""
    spans = sorted((launch.start_us, launch.end_us) for launch in launches)
    if not spans:
        return 0.0, 0.0
    busy, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return busy, max(e for _, e in spans) - spans[0][0]


# ------------------------------------------------------------------------------------------- phases
def _cache_argument(model: nn.Module) -> str:
    """transformers 5.24 renamed forward's ``past_key_values`` (a deprecated alias now) to ``cache``."""
    return "cache" if "cache" in inspect.signature(model.get_decoder().forward).parameters else "past_key_values"


def phase_steps(model: nn.Module, phase: str, batch: int, prompt: int, steps: int, patched: bool
                ) -> tuple[Callable[[], None], Callable[[], None]]:
    """(prepare, step) for one phase: ``prepare()`` before the warm-up (decode: a new cache and the prompt's
    forward), then each ``step()`` runs one step. Inputs are made here, so a step launches only the model's work."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, prompt), generator=generator).to(device)
    model.train(phase == "train")
    if phase == "prefill":
        def prefill():
            with torch.no_grad():
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return (lambda: None), prefill
    if phase == "train":
        def train():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return (lambda: None), train
    total = WARMUP_STEPS + steps
    new_ids = torch.randint(0, vocab, (total, batch, 1), generator=generator).to(device)
    positions = (prompt + torch.arange(total)).view(total, 1, 1).expand(total, batch, 1).to(device)
    cache_arg, state = _cache_argument(model), {}

    def prepare():
        from transformers import DynamicCache

        try:
            from fuselm.generation import FusedKVCache
        except ImportError:
            FusedKVCache = None  # noqa: N806
        if patched and FusedKVCache is not None:
            cache = FusedKVCache(model, batch, prompt + total)
            cache.plan(None)
        else:
            cache = DynamicCache(config=model.config)
        state.update(cache=cache, step=0)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_arg: cache})

    def decode():
        i = state["step"]
        with torch.no_grad():
            model(input_ids=new_ids[i], position_ids=positions[i], use_cache=True, logits_to_keep=1,
                  **{cache_arg: state["cache"]})
        state["step"] = i + 1

    return prepare, decode


@dataclass
class Profiled:
    """The launches of ``steps`` profiled steps of one phase, one model, one layer count."""

    launches: list[Launch]
    steps: int

    def per_step(self) -> float:
        return len(self.launches) / self.steps


def profile_phase(model: nn.Module, phase: str, batch: int, prompt: int, steps: int, patched: bool,
                  trace: Path | None = None) -> Profiled:
    cuda = next(model.parameters()).is_cuda
    prepare, step = phase_steps(model, phase, batch, prompt, steps, patched)
    prepare()
    for _ in range(WARMUP_STEPS):
        step()
    if cuda:
        torch.cuda.synchronize()  # no warm-up kernel runs into the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    named = _named_interpreter_launches() if INTERPRETING and not cuda else contextlib.nullcontext()
    with named, profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    model.eval()
    model.zero_grad(set_to_none=True)  # train's gradients: freed for the next run
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.events()
    return Profiled(device_launches(events) if cuda else host_launches(events), steps)


# ------------------------------------------------------------------------------------------- bounds
def _median_ms(fn: Callable[[], object], repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings(device: torch.device) -> dict:
    """Copy bandwidth (a 1 GiB copy, bytes read + written) and bf16 GEMM rate (8192³), measured now."""
    with torch.cuda.device(device):
        src = torch.empty(2**29, dtype=torch.bfloat16, device=device).random_()
        dst = torch.empty_like(src)
        copy_ms = _median_ms(lambda: dst.copy_(src))
        copy_gbps = 2 * src.nbytes / (copy_ms * 1e-3) / 1e9
        n = 8192
        a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
        gemm_tflops = 2 * n**3 / (_median_ms(lambda: a @ b) * 1e-3) / 1e12
    return {"copy_gbps": copy_gbps, "gemm_tflops": gemm_tflops,
            "formulas": {"copy_gbps": "2 × 1 GiB (read + written) / median time of dst.copy_(src), bf16",
                         "gemm_tflops": "2 × 8192³ / median time of a @ b, bf16 [8192, 8192] × [8192, 8192]"}}


def _layer_windows(config, layers: int) -> list[int | None]:
    try:
        from fuselm.generation.cache import sliding_windows

        windows = list(sliding_windows(config))
    except (ImportError, ValueError):
        windows = [getattr(config, "sliding_window", None)] * layers
    return (windows + [None] * layers)[:layers]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bound(model: nn.Module, phase: str, batch: int, prompt: int, steps: int, layers: int, ceilings: dict) -> dict:
    """The least time one step of ``phase`` can take at ``layers`` layers: bytes over the copy bandwidth (decode)
    or FLOPs over the GEMM rate (prefill, train); with the formula and its terms."""
    from fuselm.generation.cache import head_facts

    config = model.config
    decoder_layers = list(model.get_decoder().layers)[:layers]
    kv_heads, head_dim = head_facts(config)
    heads, hidden, vocab = config.num_attention_heads, config.hidden_size, config.vocab_size
    windows = _layer_windows(config, layers)
    element = next(model.parameters()).element_size()
    if phase == "decode":
        layer_bytes = _bytes(p for layer in decoder_layers for p in layer.parameters()) / layers
        head = model.get_output_embeddings()
        head_bytes = _bytes(head.parameters()) + _bytes(model.get_decoder().norm.parameters())
        context = prompt + WARMUP_STEPS + (steps + 1) / 2  # mean positions read per profiled step, the new one too
        kv_read = sum(2 * batch * min(context, w or context) * kv_heads * head_dim * element for w in windows)
        kv_write = layers * 2 * batch * kv_heads * head_dim * element
        total = layers * layer_bytes + head_bytes + kv_read + kv_write
        ms = total / (ceilings["copy_gbps"] * 1e9) * 1e3
        formula = (f"bytes/step = {layers} layers × {layer_bytes / 1e6:.1f} MB weights + lm_head & final norm "
                   f"{head_bytes / 1e6:.1f} MB + KV read Σ_layers 2·B {batch}·min({context:.1f} positions, window)·"
                   f"Hkv {kv_heads}·D {head_dim}·{element} B = {kv_read / 1e6:.2f} MB + KV write {kv_write / 1e6:.3f} "
                   f"MB = {total / 1e6:.1f} MB; bound = bytes / copy {ceilings['copy_gbps']:.0f} GB/s")
        return {"what": "bytes", "amount": total, "ms": ms, "formula": formula}
    tokens = batch * prompt
    weights = sum(p.numel() for layer in decoder_layers for p in layer.parameters() if p.dim() == 2)
    pairs = sum(sum(min(i + 1, w or prompt) for i in range(prompt)) for w in windows)  # causal (q, k) per row, head
    linear, attention = 2 * tokens * weights, 4 * batch * pairs * heads * head_dim
    head_tokens = batch if phase == "prefill" else tokens  # prefill keeps the last position's logits only
    lm_head = 2 * head_tokens * hidden * vocab
    factor = 3 if phase == "train" else 1
    total = factor * (linear + attention + lm_head)
    ms = total / (ceilings["gemm_tflops"] * 1e12) * 1e3
    formula = (f"FLOPs/step = {'3 × (' if factor == 3 else ''}2·{tokens} tokens·{weights / 1e6:.1f} M projection "
               f"weights ({layers} layers) + 4·B {batch}·{pairs} causal (q, k) pairs (Σ layers)·Hq {heads}·D {head_dim}"
               f" + lm_head 2·{head_tokens}·{hidden}·{vocab}{')' if factor == 3 else ''} = {total / 1e12:.3f} TFLOP; "
               f"bound = FLOPs / GEMM {ceilings['gemm_tflops']:.0f} TFLOP/s"
               + ("; backward ≈ 2 × forward" if factor == 3 else ""))
    return {"what": "flops", "amount": total, "ms": ms, "formula": formula}


# ------------------------------------------------------------------------------------------- the command
def summarise(full: Profiled, cut: Profiled, layers: int, cut_layers: int, cuda: bool) -> dict:
    """One row: launches per layer and outside the layers, and per step by kind (and GPU times on CUDA)."""
    per_layer = (full.per_step() - cut.per_step()) / (layers - cut_layers)
    kinds = Counter(launch.kind for launch in full.launches)
    row = {"launches_per_layer": per_layer, "launches_outside_layers": full.per_step() - layers * per_layer,
           "launches_per_step": full.per_step(), "launches_by_kind": {kind: kinds[kind] / full.steps for kind in KINDS}}
    top = Counter(x.name for x in full.launches).most_common(12)
    row["top_launches"] = [{"name": name, "per_step": n / full.steps} for name, n in top]
    if cuda:
        by_kind = dict.fromkeys(KINDS, 0.0)
        for launch in full.launches:
            by_kind[launch.kind] += (launch.end_us - launch.start_us) / 1e3 / full.steps
        busy, window = busy_and_window_us(full.launches)
        if not window:
            raise RuntimeError("the profiler recorded no GPU kernel in the profiled steps (CUPTI may have failed, "
                               "e.g. out of GPU memory): no GPU times to report; profile again")
        cut_busy, _ = busy_and_window_us(cut.launches)
        row.update(gpu_ms_by_kind=by_kind, busy_ms=busy / 1e3 / full.steps, window_ms=window / 1e3 / full.steps,
                   idle_share=1 - busy / window,
                   busy_us_per_layer=(busy / full.steps - cut_busy / cut.steps) / (layers - cut_layers))
    return row


def run(model_name: str, *, device: torch.device, phases: tuple[str, ...] = PHASES, batch: int = 1,
        prompt: int | None = None, layers: int | None = None, steps: int = 4, json_path: Path | None = None,
        trace: Path | None = None, console: Console | None = None) -> dict:
    """Profile ``model_name`` (a built-in config name or a local HF model directory); print the tables and return
    (and with ``json_path`` write) the results. Raises ArgumentError (one line) for a bad argument, before any work."""
    console = console or Console()
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    prompt = prompt or (512 if cuda else 32)
    config, weights = resolve(model_name)
    layers = layers or config.num_hidden_layers
    if layers < 2:
        raise ArgumentError(f"--layers {layers}: at least 2 (launches per layer are a difference of two layer counts)")
    if layers > config.num_hidden_layers:
        raise ArgumentError(f"--layers {layers}: {model_name} has {config.num_hidden_layers} decoder layers")
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions and prompt + WARMUP_STEPS + steps > max_positions:
        raise ArgumentError(f"--prompt {prompt}: with {WARMUP_STEPS + steps} decode steps it passes the model's "
                         f"max_position_embeddings {max_positions}")
    for option, path in (("--json", json_path), ("--trace", trace)):
        if path is not None and not path.parent.is_dir():
            raise ArgumentError(f"{option} {path}: the folder {path.parent} does not exist")
    cut_layers = layers // 2
    if not cuda:
        where = "no CUDA GPU" if not torch.cuda.is_available() else f"device {device}"
        console.print(f"{where}: counting on {device.type} the ops that would launch GPU kernels "
                      f"({path_name(device)}); no GPU times, bytes or bounds")
    with console.status("building the model …"):
        model = build(config, weights, layers, device, dtype)
        ceilings = measure_ceilings(device) if cuda else None
    console.print(f"[bold]fuselm profile[/] {model_name}: {type(model).__name__}, {layers} layers (per-layer figures: "
                  f"{layers} against {cut_layers}), hidden {config.hidden_size}, vocab {config.vocab_size}, "
                  f"{'random weights' if weights is None else 'weights from ' + str(weights)}, {dtype}, batch {batch}"
                  f" × {prompt} tokens, {steps} profiled steps after {WARMUP_STEPS} warm-up")
    if ceilings:
        console.print(f"ceilings measured now: copy {ceilings['copy_gbps']:.0f} GB/s "
                      f"({ceilings['formulas']['copy_gbps']}), GEMM {ceilings['gemm_tflops']:.0f} TFLOP/s "
                      f"({ceilings['formulas']['gemm_tflops']})", highlight=False)
    rows = []
    impls = ("unpatched", "patched")
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("profiling", total=len(phases) * len(impls) * 2)
        for impl in impls:
            patch = fuselm.patched(model) if impl == "patched" else contextlib.nullcontext()
            with patch as report:
                if report is not None:
                    console.print(str(report), highlight=False)
                for phase in phases:
                    profiled = {}
                    for count in (cut_layers, layers):
                        progress.update(task, description=f"{phase}, {impl}, {count} layers")
                        path = (trace.with_name(f"{trace.stem}-{phase}-{impl}.json")
                                if trace is not None and count == layers else None)
                        with first_layers(model, count):
                            profiled[count] = profile_phase(model, phase, batch, prompt, steps, impl == "patched",
                                                            path)
                        progress.advance(task)
                    row = {"phase": phase, "impl": impl,
                           **summarise(profiled[layers], profiled[cut_layers], layers, cut_layers, cuda)}
                    if cuda:
                        row["bound"] = bound(model, phase, batch, prompt, steps, layers, ceilings)
                        row["bound"]["pct_of_bound"] = 100 * row["bound"]["ms"] / row["window_ms"]
                    rows.append(row)
    result = {
        "model": model_name, "config_from": MODELS[model_name].source if model_name in MODELS else model_name,
        "model_class": type(model).__name__, "layers": layers, "layers_compared": cut_layers,
        "hidden_size": config.hidden_size, "vocab_size": config.vocab_size, "random_weights": weights is None,
        "device": str(device), "gpu": torch.cuda.get_device_name(device) if cuda else None, "dtype": str(dtype),
        "ops_path": path_name(device), "backend": fuselm.get_backend(), "batch": batch, "prompt": prompt,
        "steps": steps, "warmup_steps": WARMUP_STEPS, "torch": torch.__version__, "fuselm": fuselm.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ceilings": ceilings, "kinds": list(KINDS), "rows": rows,
        "method": ("launches: the kernels, memcpys and memsets the GPU ran; per layer = (launches per step at "
                   "`layers` − at `layers_compared`) / (their difference); outside layers = per step − layers × "
                   "per layer; GPU ms by kind and idle share: the whole step at `layers`; idle share = 1 − (time "
                   "any kernel ran) / (first kernel start to last kernel end)" if cuda else
                   "no CUDA: launches are the innermost computing aten ops and the Triton launches, counted on the "
                   "CPU; per layer = (per step at `layers` − at `layers_compared`) / (their difference)"),
    }
    for phase in phases:
        console.print(table(result, phase))
        if cuda:
            for row in rows:
                if row["phase"] == phase:
                    console.print(f"  {row['impl']}: {row['bound']['formula']}", highlight=False)
    console.print(f"[dim]{result['method']}[/]", highlight=False)
    if not cuda and result["ops_path"].startswith("PyTorch reference"):
        console.print("[dim]the patched model ran each fused op's PyTorch reference, which is not fused (it may count "
                      "more ops than HF's); TRITON_INTERPRET=1 FUSELM_BACKEND=triton counts its Triton launches[/]",
                      highlight=False)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1))
        console.print(f"wrote {json_path}")
    if trace is not None:
        console.print(f"Chrome traces: {trace.with_name(trace.stem + '-<phase>-<impl>.json')}")
    return result


def metrics(cuda: bool) -> list[tuple[str, Callable[[dict], str]]]:
    """The table's rows: (label, the cell of one impl's result row)."""
    rows = [("launches / layer", lambda r: f"{r['launches_per_layer']:.1f}"),
            ("launches outside the layers", lambda r: f"{r['launches_outside_layers']:.1f}"),
            ("launches / step", lambda r: f"{r['launches_per_step']:.1f}")]
    if not cuda:
        return rows + [(f"  {kind} launches", lambda r, kind=kind: f"{r['launches_by_kind'][kind]:.1f}")
                       for kind in KINDS]
    return rows + [("GPU ms / step (first kernel to last)", lambda r: f"{r['window_ms']:.3f}"),
                   ("GPU busy µs / layer", lambda r: f"{r['busy_us_per_layer']:.1f}"),
                   ("idle between kernels %", lambda r: f"{100 * r['idle_share']:.1f}"),
                   *((f"  {kind} ms", lambda r, kind=kind: f"{r['gpu_ms_by_kind'][kind]:.3f}") for kind in KINDS),
                   ("bound ms / step", lambda r: f"{r['bound']['ms']:.3f}"),
                   ("% of bound (bound / GPU ms)", lambda r: f"{r['bound']['pct_of_bound']:.1f}")]


def table(result: dict, phase: str) -> Table:
    """One phase: a row per figure, a column per impl (unpatched, patched)."""
    cuda = result["ceilings"] is not None
    what = {"prefill": f"one forward of {result['prompt']} tokens",
            "decode": f"one-token steps after a {result['prompt']}-token prompt",
            "train": f"forward + backward of {result['prompt']} tokens"}[phase]
    view = Table(title=f"{phase}: {what}, batch {result['batch']}, {result['layers']} layers, per step")
    rows = [row for row in result["rows"] if row["phase"] == phase]
    view.add_column(phase)
    for row in rows:
        view.add_column(row["impl"], justify="right")
    for label, cell in metrics(cuda):
        view.add_row(label, *(cell(row) for row in rows))
    return view

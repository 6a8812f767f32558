"""Argument checks and Triton launch helpers shared by every op family."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import re
import sys
import typing
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import is_fake

from fuselm.backend import INTERPRETING
from fuselm.ops._triton import gdc_launch_dependents, gdc_wait, tl, triton


def _fix_interpreter_loop_bounds() -> None:
    """Makes kernel loops over runtime bounds work in the interpreter of triton < 3.7 with numpy >= 2.4.

    That interpreter holds every scalar as a 1-element array, and its ``tl.tensor.__index__`` (which
    Python's ``range`` calls on each bound) does ``int(array)``: numpy 2.4 refuses that for arrays of
    rank > 0 (older numpy warns), so each loop over a runtime bound (the vocabulary loops of
    cross-entropy, the persistent RMSNorm backward, ...) failed with "only 0-dimensional arrays can be
    converted to Python scalars". Triton 3.7 takes the array's element instead; so does this, for the
    older interpreters. It goes once triton >= 3.7 is the floor.
    """
    try:
        from triton import __version__ as triton_version
        from triton.runtime import interpreter
    except ImportError:  # no triton: every op runs its reference
        return
    if tuple(int(part) for part in triton_version.split(".")[:2]) >= (3, 7):
        return
    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_with_scalar_index(tensor, *args):
        patch_lang_tensor(tensor, *args)  # its scope restores the class's own __index__ after the launch
        tensor.__index__ = lambda self: int(self.handle.data.reshape(()))

    interpreter._patch_lang_tensor = patch_with_scalar_index


if INTERPRETING:
    _fix_interpreter_loop_bounds()


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
LOCAL_SHARD_OPS = ("rms_norm", "add_rms_norm", "silu_mul", "gelu_tanh_mul")


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a torch.distributed DTensor (FSDP2's sharded parameters, tensor parallelism), cheaply: a
    plain tensor is not, and none exists before torch.distributed.tensor is imported."""
    if type(t) in _PLAIN_TENSORS or t is None:
        return False
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def check_not_dtensor(name: str, t: object) -> None:
    """A TypeError naming ``name`` for a DTensor: the op works on plain tensors (the README's Multi-GPU section)."""
    if is_dtensor(t):
        raise TypeError(
            f"{name} is a DTensor (placements {tuple(t.placements)}): this fuselm op takes plain tensors; pass "
            f"{name}.full_tensor() (or .to_local() where its shard alone is what the op should see). "
            f"Of fuselm's ops, {', '.join(LOCAL_SHARD_OPS)} take DTensors and run on the local shards")


def check_tensor(name: str, t: object, *, min_rank: int = 1, rank: int | None = None) -> torch.Tensor:
    """A floating-point plain (not D-) tensor of the given rank, or a TypeError/ValueError naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_not_dtensor(name, t)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if rank is not None and t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(t.shape)}")
    if t.dim() < min_rank:
        raise ValueError(f"{name} must have rank >= {min_rank}, got shape {tuple(t.shape)}")
    return t


def check_real(name: str, value: object) -> float:
    """A Python int or float, as a float, or a TypeError naming ``name``. Tensors are refused: the kernels
    take these values as launch arguments, and reading one from a device tensor would sync with the host."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float (or int), got {type(value).__name__}")
    return float(value)


def check_same(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Every tensor in ``others`` is on ``reference``'s device and has its dtype."""
    for name, t in others.items():
        if t is None:
            continue
        check_not_dtensor(name, t)
        if t.device != reference.device:
            raise ValueError(f"{name} is on {t.device} but {reference_name} is on {reference.device}")
        if t.dtype != reference.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {reference_name} has dtype {reference.dtype}")


def check_same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        check_not_dtensor(name, t)
        if t is not None and t.device != reference.device:
            raise ValueError(f"{name} is on {t.device} but {reference_name} is on {reference.device}")


def _shard_dims(placements) -> set[int]:
    return {p.dim for p in placements if p.is_shard()}


def on_local_shards(op: Callable, lead_name: str, tensors: dict[str, torch.Tensor | None],
                    replicated: tuple[str, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``op`` (a row-wise fuselm op: each row of the last dimension computed alone) on DTensors, through their
    local shards: ``op(**locals)``, each output a DTensor placed as ``tensors[lead_name]``.

    The lead and every other tensor not named in ``replicated`` must be DTensors of one mesh with the same global
    shape and placements, none of them Partial or sharding the last dimension (a row must be whole on each rank);
    those in ``replicated`` (weights) must be Replicate everywhere, or plain tensors (whole on every rank). The
    gradient of a replicated DTensor is Partial over the mesh dimensions that shard the lead (each rank's rows add
    theirs), so ``.full_tensor()`` or the optimiser's reduction sums the ranks'. Anything else: a ValueError or
    TypeError naming the argument.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    lead = tensors[lead_name]
    if not is_dtensor(lead):
        other = next(name for name, t in tensors.items() if is_dtensor(t))
        raise TypeError(f"{other} is a DTensor but {lead_name} is a {type(lead).__name__}: {lead_name} must be a "
                        "DTensor too (its shards decide where the op runs)")
    mesh, placements = lead.device_mesh, lead.placements
    last = lead.dim() - 1
    if any(p.is_partial() for p in placements) or last in _shard_dims(placements):
        raise ValueError(f"{lead_name} is a DTensor placed {tuple(placements)}: fuselm runs this op on local shards "
                         "only for Shard placements of dimensions other than the last, and Replicate")
    local, grad_placements = {}, [Partial() if p.is_shard() else Replicate() for p in placements]
    for name, t in tensors.items():
        if t is None or (name in replicated and not is_dtensor(t)):
            local[name] = t
            continue
        if not is_dtensor(t):
            raise TypeError(f"{name} must be a DTensor placed as {lead_name} ({tuple(placements)}), got a plain "
                            f"{type(t).__name__}")
        if t.device_mesh != mesh:
            raise ValueError(f"{name} is on device mesh {t.device_mesh} but {lead_name} on {mesh}")
        if name in replicated:
            if not all(p.is_replicate() for p in t.placements):
                raise ValueError(f"{name} must be replicated (Replicate on every mesh dimension) for this op on "
                                 f"DTensors, got placements {tuple(t.placements)}")
            local[name] = t.to_local(grad_placements=grad_placements)
            continue
        if name != lead_name and (tuple(t.placements) != tuple(placements) or t.shape != lead.shape):
            raise ValueError(f"{name} is a DTensor of shape {tuple(t.shape)} placed {tuple(t.placements)} but "
                             f"{lead_name} of shape {tuple(lead.shape)} placed {tuple(placements)}: they must match")
        local[name] = t.to_local()
    outputs = op(**local)

    def distributed(out: torch.Tensor) -> torch.Tensor:
        shape = (*lead.shape[:-1], out.shape[-1])
        return DTensor.from_local(out, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    return distributed(outputs) if isinstance(outputs, torch.Tensor) else tuple(map(distributed, outputs))


poison_outputs = False  # tests set this: kernel outputs start as NaN, so unwritten elements show


def new_output(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised output tensor for a kernel to fill (NaN-filled while ``poison_outputs``)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if poison_outputs else out


def new_output_like(x: torch.Tensor) -> torch.Tensor:
    """Like :func:`new_output`, in x's shape, dtype, device and (when x is dense) memory order."""
    out = torch.empty_like(x, memory_format=torch.preserve_format)
    return out.fill_(float("nan")) if poison_outputs else out


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as a 2-D [rows, x.shape[-1]] with unit column stride (copies only if it must)."""
    if x.dim() == 0:
        raise ValueError("expected a tensor of rank >= 1")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x
    rows = x.shape[:-1].numel()  # not -1: a view of [..., 0] cannot infer it
    try:
        return x.view(rows, x.shape[-1])
    except RuntimeError:
        return x.reshape(rows, x.shape[-1])


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere): sizes persistent and split grids."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


# Programmatic dependent launch (Hopper and later): a decode step is a chain of short kernels, and each one's launch,
# ramp-up and tail leave the GPU partly idle (the ~5 us fixed cost per projection kernel, benchmarks/NOTES.md).
# Launched with ``launch_pdl``, a kernel may start its programs once every program of the kernel before it has passed
# its main loop (``let_next_kernel_launch``); they prefetch their first weight bytes into L2 (weights: nothing in the
# step writes them) and wait (``wait_for_previous_kernel``) before they touch anything else. Measured on the H200
# (benchmarks/NOTES.md, layer step us, session 8): B1 x 512 145.2 -> 139.5, but B32 x 1024 182.6 -> 184.0, and
# releasing the next kernel at the start instead was slower everywhere; so up to 8 rows then. With today's kernels
# (session 26, H100, alternating runs) dependent launches at 32 rows took B32 x 1024 from 219.2-219.6 to 216.9-217.0
# us back to back, and B32's generate from 3933 to 3980 tok/s; on the H200 (session 30, alternating runs) they took it
# from 168.3 to 175.1-175.2 us back to back, and B32's generate from 4880-4883 to 4723-4725 tok/s. So the row limit is
# a measured per-GPU setting: the GPU's tuning table's ``dependent_max_rows`` (the H200's 8), else DEPENDENT_MAX_ROWS;
# a table may also set one op's limit (``dependent_max_rows.<op>``, the ops of DEPENDENT_OPS), since which of B32's
# kernels lose on the H200 is not known yet. FUSELM_DEPENDENT_LAUNCH=0 (or ``use_dependent_launch = False``) launches
# every kernel as before; FUSELM_DEPENDENT_MAX_ROWS overrides the limits on every GPU (benchmarks' A/B): a comma list
# of ``N`` (every op) and ``op=N`` (that op), e.g. ``32,decode_attention=8``; FUSELM_WEIGHT_PREFETCH sets the
# prefetched bytes per weight row (benchmarks; 0: none), FUSELM_KV_PREFETCH_TILES the K/V tiles per program
# that decode attention prefetches before its wait (benchmarks; 0: none).
def _env_count(name: str, default: int) -> int:
    """The environment variable ``name`` as a non-negative int (``default`` when unset); a clear error otherwise."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"{name} must be a non-negative integer, got {text!r}")
    return int(text)


DEPENDENT_OPS = ("qkv_rope", "decode_attention", "linear_residual", "norm_gated_linear")  # kernels launched dependently


def _dependent_rows_override(text: str) -> dict[str | None, int]:
    """FUSELM_DEPENDENT_MAX_ROWS's text -> {op: rows}, the key None for every op; a clear error for a bad item."""
    limits: dict[str | None, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        op, _, rows = item.rpartition("=")
        op = op.strip() or None
        if op is not None and op not in DEPENDENT_OPS:
            raise ValueError(f"FUSELM_DEPENDENT_MAX_ROWS names an unknown op {op!r} in {text!r}; the ops are "
                             f"{', '.join(DEPENDENT_OPS)}")
        if not rows.strip().isdigit():
            raise ValueError(f"FUSELM_DEPENDENT_MAX_ROWS must be a comma list of N and op=N, N a non-negative "
                             f"integer; got {item!r} in {text!r}")
        limits[op] = int(rows)
    return limits


use_dependent_launch = os.environ.get("FUSELM_DEPENDENT_LAUNCH", "1") != "0"
DEPENDENT_MAX_ROWS = 32  # on a GPU whose tuning table sets no dependent_max_rows
dependent_max_rows_override = _dependent_rows_override(os.environ.get("FUSELM_DEPENDENT_MAX_ROWS", ""))
weight_prefetch_bytes = _env_count("FUSELM_WEIGHT_PREFETCH", 512)
kv_prefetch_tiles = _env_count("FUSELM_KV_PREFETCH_TILES", 2)


@functools.cache
def _supports_dependent_launch(device: torch.device) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(device) >= (9, 0)


def dependent_max_rows(device: torch.device, op: str) -> int:
    """The most rows a launch of ``op`` (one of DEPENDENT_OPS) on ``device`` (CUDA) may have and still be dependent,
    the first found of: FUSELM_DEPENDENT_MAX_ROWS's ``op=N``, its ``N``, the GPU's tuning table's
    ``dependent_max_rows.<op>`` and ``dependent_max_rows`` settings, DEPENDENT_MAX_ROWS."""
    for key in (op, None):
        if key in dependent_max_rows_override:
            return dependent_max_rows_override[key]
    settings = tuning_settings(device_name(device))
    return settings.get(f"dependent_max_rows.{op}", settings.get("dependent_max_rows", DEPENDENT_MAX_ROWS))


def dependent_settings() -> dict:
    """Whether this process launches dependently and, on its current CUDA device, each op's row limit (what a benchmark
    run records beside its rows)."""
    if not (use_dependent_launch and torch.cuda.is_available()):
        return {"dependent_launch": False}
    device = torch.device("cuda", torch.cuda.current_device())
    return {"dependent_launch": _supports_dependent_launch(device),
            "dependent_max_rows": {op: dependent_max_rows(device, op) for op in DEPENDENT_OPS}}


def dependent_launch(device: torch.device, n_rows: int, *, op: str, prefetch: bool = True) -> dict:
    """The launch keywords of ``op``'s kernel (one of DEPENDENT_OPS), which has a ``DEPENDENT`` constexpr (and, with
    ``prefetch``, ``PREFETCH_LINES``: 128-byte lines per weight row to prefetch): on, with ``launch_pdl``, for up to
    :func:`dependent_max_rows` rows where the GPU (sm_90+) and triton support it; off (both 0) elsewhere, the
    interpreter included."""
    if op not in DEPENDENT_OPS:
        raise ValueError(f"op must be one of {DEPENDENT_OPS}, got {op!r}")
    on = (use_dependent_launch and n_rows > 0 and not INTERPRETING and device.type == "cuda"
          and _supports_dependent_launch(device) and n_rows <= dependent_max_rows(device, op))
    lines = {"PREFETCH_LINES": triton.next_power_of_2(weight_prefetch_bytes // 128) if on and weight_prefetch_bytes
             >= 128 else 0} if prefetch else {}
    return {"DEPENDENT": True, "launch_pdl": True, **lines} if on else {"DEPENDENT": False, **lines}


@triton.jit
def wait_for_previous_kernel(DEPENDENT: tl.constexpr):
    """With DEPENDENT (a dependent launch): wait until the kernel before this one has finished and its writes are
    visible. Call it before touching any tensor an earlier kernel may write; only what no kernel writes (weights)
    may be read before it."""
    if DEPENDENT:
        gdc_wait()


@triton.jit
def let_next_kernel_launch(DEPENDENT: tl.constexpr):
    """With DEPENDENT: the next kernel may start its programs once every program of this one has called this (after
    its main loop; they then wait for this kernel's end before reading its outputs)."""
    if DEPENDENT:
        gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(ptrs, mask):
    """Each masked-in address's 128-byte line into L2 (prefetch.global.L2), nothing returned."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


# Per device, int32 counters that are zero between launches (the split kernels' tickets: decode attention's, the
# split-K projections'); the last buffer is the one in use. A buffer outgrown is kept: a CUDA graph captured with it
# still writes it on replay.
counters: dict[torch.device, list[torch.Tensor]] = {}


def zeroed_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` zeroed int32 counters. Every launch that takes tickets leaves its counters at zero, and
    launches on one stream run one after another, so one buffer per device serves every such kernel. First use
    allocates it (do it before CUDA-graph capture; during a capture a too-small buffer is replaced, for that call
    only, by a zeroed one the graph owns)."""
    buffers = counters.setdefault(device, [])
    if buffers and buffers[-1].numel() >= count:
        return buffers[-1]
    fresh = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        buffers.append(fresh)
    return fresh


quick_tuning = False  # GPU tests set this: configs are timed in ~1 ms each instead of ~30 ms


def _time_config(kernel_call, quantiles):
    """How the autotuner times one config: 30 ms of calls (hundreds of calls of fuselm's longest kernels, whose
    medians settle well within that; triton's default is 125 ms), or a token run while ``quick_tuning``."""
    budget = {"warmup": 1, "rep": 1} if quick_tuning else {"warmup": 5, "rep": 25}
    return triton.testing.do_bench(kernel_call, quantiles=quantiles, **budget)


parallel_compile = True  # a new autotuning key's configs compile in threads before they are timed (see below)


def compiling_in_parallel(tuner):
    """``tuner`` (a ``triton.autotune`` kernel) made to compile a new key's configs together, in a thread pool, before
    it times them one by one: a first call compiles tens of configs, one after another otherwise (the cold first call
    of a decode step, benchmarks/NOTES.md). Through Triton's own ``AsyncCompileMode``: each config's
    launch runs as a warm-up (compile only, nothing launched), its compile submitted to the pool; the timing runs then
    find the compiled kernels. A config that fails to compile is left to the timing run, which handles it as triton
    does (an infinite time). Without that module (triton 3.6 and 3.9 have it, 3.2 not), or with ``parallel_compile``
    off, triton's sequential path runs. First, a key the GPU's tuning table holds keeps only that config
    (:func:`_from_table`): nothing else compiles, nothing is compared."""
    if not hasattr(tuner, "prune_configs"):  # no triton: the stand-in decorators left the plain function
        return tuner
    try:
        from triton.runtime import _async_compile
    except ImportError:
        _async_compile = None
    prune = tuner.prune_configs

    def prune_and_compile(kwargs, *rest):
        configs = _from_table(tuner, kwargs, prune(kwargs, *rest))
        if (not parallel_compile or len(configs) < 2 or _async_compile is None
                or _async_compile.active_mode.get() is not None):
            return configs
        args = list(tuner.nargs.values())  # this launch's positional arguments (triton sets nargs before pruning)
        with (ThreadPoolExecutor(min(len(configs), os.cpu_count() or 1)) as pool,
              _async_compile.AsyncCompileMode(pool, ignore_errors=True)):
            for config in configs:
                with contextlib.suppress(Exception):  # met again, and handled, by its timing run
                    tuner.fn.run(*args, **{**kwargs, "warmup": True}, **config.all_kwargs())
        return configs

    tuner.prune_configs = prune_and_compile
    return tuner


# Shipped tuning tables: per GPU model, the configs the autotuners chose for the shapes fuselm's benchmarks run
# (Llama-3-8B's), written by benchmarks/tuning_table.py from their results' ``autotune_picks``. A key found there runs
# that config without timing the others (a first call compiles one config per kernel instead of all); any other key,
# GPU or config list tunes as before. FUSELM_TUNING_TABLE=0 (or ``use_tuning_table = False``) always tunes.
TUNING_DIR = Path(__file__).with_name("tuning")
use_tuning_table = os.environ.get("FUSELM_TUNING_TABLE", "1") != "0"
_TABLE_HITS: set[tuple[str, str]] = set()  # (kernel, key) launched from a table entry, for autotune_picks


def tuning_table_path(device_name: str) -> Path:
    """The table file for a GPU model: ``torch.cuda.get_device_name()`` lower-cased, non-alphanumerics as dashes."""
    return TUNING_DIR / f"{re.sub(r'[^a-z0-9]+', '-', device_name.lower()).strip('-')}.json"


@functools.cache
def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` of a CUDA device, asked once."""
    return torch.cuda.get_device_name(device)


@functools.cache
def _table_file(device_name: str) -> dict:
    """The GPU model's shipped table as written (empty where it has none)."""
    path = tuning_table_path(device_name)
    return json.loads(path.read_text()) if path.is_file() else {}


@functools.cache
def _tuning_table(device_name: str) -> dict[tuple[str, str], dict]:
    picks = _table_file(device_name).get("picks", [])
    return {(pick["kernel"], json.dumps(pick["key"])): pick["config"] for pick in picks}


@functools.cache
def tuning_settings(device_name: str) -> dict[str, int]:
    """The launch settings measured on a GPU model, from its table's ``settings`` (each ``{"value", "source"}``; e.g.
    ``dependent_max_rows``): {name: value}, empty where the table has none. Read with the table on or off
    (``use_tuning_table`` governs the config picks only)."""
    return {name: entry["value"] for name, entry in _table_file(device_name).get("settings", {}).items()}


def _key_text(key: tuple) -> str:
    """A tuning key as :func:`autotune_picks` writes it (JSON; values that are not numbers as strings)."""
    return json.dumps([value if isinstance(value, (int, float, bool)) else str(value) for value in key])


def _tuning_key(tuner, kwargs: dict) -> tuple:
    """The key triton's Autotuner.run files the launch it is tuning under (its positional arguments in
    ``tuner.nargs``): :func:`launch_key`."""
    return launch_key(tuner, frozenset(tuner.arg_names), tuple(tuner.nargs.values()), kwargs)


def launch_device(tuner) -> torch.device | None:
    """The device of the launch ``tuner`` is tuning: its first tensor argument's."""
    return next((value.device for value in tuner.nargs.values() if isinstance(value, torch.Tensor)), None)


def _from_table(tuner, kwargs: dict, configs: list) -> list:
    """[the table's config for this launch] when the table of the launch's GPU has this key and that config is among
    ``configs`` (the pruned list), else ``configs``."""
    if not use_tuning_table:
        return configs
    device = launch_device(tuner)
    if device is None or device.type != "cuda":
        return configs
    name, key = getattr(tuner.fn, "__name__", ""), _key_text(_tuning_key(tuner, kwargs))
    chosen = _tuning_table(device_name(device)).get((name, key))
    for config in configs if chosen is not None else ():
        if {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages} == chosen:
            _TABLE_HITS.add((name, key))
            return [config]
    return configs


_TUNERS: list = []  # every GPU autotuner :func:`autotune` made, for :func:`autotune_picks`


def launch_key(tuner, names: frozenset, args: tuple, kwargs: dict) -> tuple:
    """The key triton's ``Autotuner.run`` files the launch ``tuner.run(*args, **kwargs)`` under: the key arguments'
    values, then every tensor argument's dtype as a string (triton 3.2-3.9; should that change, table lookups and
    direct launches miss, and triton's path runs). ``names`` is ``frozenset(tuner.arg_names)``."""
    named = dict(zip(tuner.arg_names, args))
    named.update((name, value) for name, value in kwargs.items() if name in names)
    return tuple([named[name] for name in tuner.keys if name in named]
                 + [str(value.dtype) for value in named.values() if hasattr(value, "dtype")])


def launching_tuned_configs_directly(tuner):
    """``tuner`` (a ``triton.autotune`` kernel) made to launch a key it has tuned straight through its kernel's
    ``run``, with the config it chose, as its own ``run`` does after the same cache lookup; a new key, one config, or
    a config with a pre-hook take triton's path. Triton's ``run`` builds the key with a list-membership test per
    argument (quadratic in the arguments): a qkv_rope launch (67 arguments) spends 31 µs there against 11 here, on
    the CPU machine. An eager prefill or training step keeps ahead of the GPU only when each launch is cheap
    (benchmarks/NOTES.md, session 19)."""
    if not hasattr(tuner, "cache"):  # no triton: the stand-in decorators left the plain function
        return tuner
    tuned_run, names = tuner.run, frozenset(tuner.arg_names)

    def run(*args, **kwargs):
        if len(tuner.configs) > 1:
            config = tuner.cache.get(launch_key(tuner, names, args, kwargs))
            if config is not None and config.pre_hook is None:
                tuner.best_config = config
                return tuner.fn.run(*args, **kwargs, **config.all_kwargs())
        return tuned_run(*args, **kwargs)

    tuner.run = run
    return tuner


def autotune(configs: list[triton.Config], key: list[str], **options):
    """``triton.autotune`` on a GPU (compiling a new key's configs in parallel: :func:`compiling_in_parallel`); under
    the interpreter, which cannot time, one config: the first, or the one :func:`forced_config` forces. Either way
    ``kernel.configs`` lists them all and ``kernel.keys`` names the key arguments."""
    if not INTERPRETING:
        tune = triton.autotune(configs=configs, key=key, do_bench=_time_config, **options)

        def tuned(fn):
            tuner = launching_tuned_configs_directly(compiling_in_parallel(tune(fn)))
            _TUNERS.append(tuner)
            return tuner

        return tuned

    def pin(fn):
        # each launch reads the pinned config's values, so the grid and best_config always agree
        kernel = triton.heuristics({name: (lambda _args, name=name: kernel.best_config.kwargs[name])
                                    for name in configs[0].kwargs})(fn)
        kernel.configs, kernel.keys = configs, key
        kernel.best_config = configs[0]  # what triton.autotune exposes after a launch
        return kernel

    return pin


def autotune_picks(tuners: list | None = None) -> list[dict]:
    """What the autotuners chose so far in this process, one entry per tuned key: ``{"kernel", "key", "config",
    "of", "from_table"}`` with the key's values and the chosen config's meta-parameters, warps and stages as strings
    and numbers (JSON), how many configs it was chosen from, and whether a tuning table chose it (nothing timed).
    For benchmarks' results, and the tables' source (benchmarks/tuning_table.py).
    ``tuners`` defaults to every GPU autotuner of :func:`autotune` (none under the interpreter, which does not tune).
    """
    picks = []
    for tuner in _TUNERS if tuners is None else tuners:
        name = getattr(tuner.fn, "__name__", repr(tuner.fn))
        for key, config in tuner.cache.items():
            picks.append({"kernel": name, "key": json.loads(_key_text(key)),
                          "config": {**config.kwargs, "num_warps": config.num_warps,
                                     "num_stages": config.num_stages},
                          "of": len(tuner.configs), "from_table": (name, _key_text(key)) in _TABLE_HITS})
    return picks


@contextlib.contextmanager
def forced_config(kernel, index: int) -> Iterator[None]:
    """Launches of ``kernel`` (an :func:`autotune` kernel) run its config ``index`` instead of the
    tuned (GPU) or first (interpreter) one, so tests can check every config a GPU may pick."""
    configs = kernel.configs
    if INTERPRETING:
        previous, kernel.best_config = kernel.best_config, configs[index]
    else:
        kernel.configs = [configs[index]]  # triton's Autotuner runs a lone config without tuning
    try:
        yield
    finally:
        if INTERPRETING:
            kernel.best_config = previous
        else:
            kernel.configs = configs


def on_input_device(impl):
    """``impl`` run with its first argument's CUDA device current, so its Triton launches (which use the current
    device and its stream) land where the tensors live: a model spread over GPUs by ``device_map="auto"`` calls
    ops on ``cuda:1`` while ``cuda:0`` is current. CPU and meta tensors (``get_device() == -1``) need nothing.
    When the device is already current, as on one GPU, the cost is one comparison (measured in
    ``benchmarks/device_guard_bench.py``)."""

    @functools.wraps(impl)
    def guarded(*args):
        index = args[0].get_device()
        if index < 0 or index == torch.cuda.current_device():
            return impl(*args)
        with torch.cuda.device(index):
            return impl(*args)

    return guarded


class FusedOp:
    """One ``fuselm::<name>`` op (torch.library custom op with a fake and, optionally, autograd).

    Calling it goes through torch.library while torch.compile traces it (fake tensors) or the
    profiler records, so both see ``fuselm::<name>``; otherwise straight into ``impl``, inside a
    torch.autograd.Function running the same ``setup_context`` and ``backward``. Same arithmetic,
    without torch.library's per-call Python dispatch (~55 µs of host time per call measured on the
    GPU machine, benchmarks/NOTES.md). An op that writes into its arguments (``mutates_args``) goes
    straight into ``impl`` when no tensor argument needs a gradient (autograd then keeps
    torch.library's route), and bumps those arguments' version counters as torch.library would:
    the prefill's cache write is one such call per layer. Either way ``impl`` runs under its first
    argument's device (:func:`on_input_device`), including inside compiled graphs, which call the
    registered op.
    """

    def __init__(self, name: str, impl, *, fake, mutates_args: tuple[str, ...] = (), setup_context=None,
                 backward=None):
        schema = torch.library.infer_schema(impl, mutates_args=mutates_args)
        self.impl = impl = on_input_device(impl)
        names = list(inspect.signature(impl).parameters)
        self.mutated = tuple(names.index(name) for name in mutates_args)  # positions whose versions a call bumps
        self.op = torch.library.custom_op(f"fuselm::{name}", impl, mutates_args=mutates_args, schema=schema)
        self.op.register_fake(fake)
        self.autograd = None
        # an op returning list[Tensor]: torch.autograd.Function returns (and passes gradients as) a tuple
        self.list_output = typing.get_origin(inspect.signature(impl, eval_str=True).return_annotation) is list
        if backward is not None:
            self.op.register_autograd(backward, setup_context=setup_context)

            def forward(ctx, *args):
                output = impl(*args)
                setup_context(ctx, args, output)
                return tuple(output) if self.list_output else output

            def backward_of_apply(ctx, *grads):
                return backward(ctx, *([list(grads)] if self.list_output else grads))

            self.autograd = type(f"{name}_autograd", (torch.autograd.Function,),
                                 {"forward": staticmethod(forward), "backward": staticmethod(backward_of_apply)})

    def __call__(self, *args):
        if torch.compiler.is_compiling() or torch.autograd._profiler_enabled() or is_fake(args[0]):
            return self.op(*args)
        if self.mutated:
            if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                return self.op(*args)
            output = self.impl(*args)
            for index in self.mutated:
                if args[index] is not None:
                    torch.autograd.graph.increment_version(args[index])
            return output
        if self.autograd is not None and torch.is_grad_enabled():
            output = self.autograd.apply(*args)
            return list(output) if self.list_output else output
        return self.impl(*args)

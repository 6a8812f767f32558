"""Recognition: which fused class each module of a model gets, or why it is left alone.

Candidates are found by HF's class-naming convention (``*RMSNorm``, ``*Attention``, ``*MLP``,
``*DecoderLayer``, ``*ForCausalLM``: :func:`kind_of`); what each computes is read from its
attributes, its config and the family table (:mod:`fuselm.patching.families`), and checked by a
probe where the table does not vouch for it:

- RMSNorm: always probed, once per class and plain-valued settings (eps, flags), on a CPU copy,
  against fuselm's reference under the table's casting/offset (or, for a family not in the table,
  each known one): fp32 and bf16 inputs, fp32 and bf16 weights, an eps that matters. Patched only on
  bit-exact agreement.
- RoPE: the module-level ``apply_rotary_pos_emb`` that the attention forward calls is probed (full
  and partial rotary width) against fuselm's reference. The attention class gets a copy of HF's own
  forward whose globals map that one name to fuselm's drop-in; nothing else of the forward changes.
- MLP: the activation module is probed (SiLU or tanh-GELU); for a family not in the table the whole
  forward is also run once on the module's device, HF's against fuselm's, before patching.
- Decoder layer: only pre-norm and sandwich-norm families in the table (parallel-residual and
  post-norm layers stay HF's).
- Loss: :func:`fuselm.patching.loss.loss_unsupported_reason`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import types
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fuselm.backend import use_backend
from fuselm.ops.rms_norm import CASTINGS, rms_norm_reference
from fuselm.ops.rope import rope_reference
from fuselm.patching.classes import fused_subclass, with_global
from fuselm.patching.families import Family, family_name, family_of
from fuselm.patching.loss import fused_causal_lm_class, loss_unsupported_reason
from fuselm.patching.modules import (
    FusedDecoderLayer,
    FusedGatedMLP,
    FusedLoraLinear,
    FusedRMSNorm,
    LayerSpec,
    MlpSpec,
    NormSpec,
    fused_apply_rotary_pos_emb,
    gated_mlp,
)

_CLASS_SUFFIXES = {"rms_norm": ("rmsnorm",), "rope": ("attention",), "mlp": ("mlp", "moeblock", "moe"),
                   "decoder_layer": ("decoderlayer",), "loss": ("forcausallm",)}
_ROPE_FUNCTION = "apply_rotary_pos_emb"
# PEFT's LoRA layers around an nn.Linear and bitsandbytes' 4-bit and (counted, left alone) 8-bit linears
_LORA_CLASSES = ("Linear", "Linear4bit", "Linear8bitLt")


def kind_of(cls: type) -> str | None:
    """Which kind of module (a key of fuselm.patch's options) a class is a candidate for, by its name."""
    if cls.__name__ in _LORA_CLASSES and cls.__module__.startswith("peft.tuners.lora"):
        return "lora"
    name = cls.__name__.lower()
    kind = next((kind for kind, suffixes in _CLASS_SUFFIXES.items() if name.endswith(suffixes)), None)
    if kind == "loss" and not any(base.__name__ == "PreTrainedModel" for base in cls.__mro__):
        return None  # e.g. PEFT's PeftModelForCausalLM: the HF model inside it is the one to patch
    return kind


# ----------------------------------------------------------------------------------- probes
_NORM_ARITHMETIC = (("llama", 0.0), ("gemma", 1.0), ("gemma", 0.0), ("llama", 1.0), ("none", 0.0))
_PROBE_EPS = 1e-2  # large enough to change every probe row's result if the class used another eps
_GLU_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
_PROBE_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}  # relative; half types: 2e-2


def _probe_norm(cls: type, module: nn.Module, eps_attr: str,
                candidates: tuple[tuple[str, float], ...]) -> NormSpec | None:
    """The first (casting, offset) whose fuselm reference equals ``cls.forward`` bit for bit, if any."""
    stand_in = copy.deepcopy(module)
    setattr(stand_in, eps_attr, _PROBE_EPS)
    hidden = module.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    row_scales = torch.tensor([[0.05], [1.0], [20.0], [0.3]])
    x = torch.randn(4, hidden, generator=generator) * row_scales
    w = 0.1 + 0.5 * torch.randn(hidden, generator=generator)
    remaining = list(candidates)
    with torch.no_grad():
        for x_dtype, w_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                 (torch.bfloat16, torch.float32)):
            stand_in.weight = nn.Parameter(w.to(w_dtype), requires_grad=False)
            xs = x.to(x_dtype)
            expected = cls.forward(stand_in, xs)
            remaining = [(casting, offset) for casting, offset in remaining
                         if _identical(rms_norm_reference(xs, stand_in.weight, _PROBE_EPS, offset, casting), expected)]
    return NormSpec(eps_attr, *remaining[0]) if remaining else None


def _identical(a: object, b: object) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)


def _close(out: object, ref: torch.Tensor) -> bool:
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape or out.dtype != ref.dtype:
        return False
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)
    return bool(err <= _PROBE_TOLERANCE.get(ref.dtype, 2e-2))  # NaN fails


def _probe_activation(act: object) -> str | None:
    """Which fused GLU activation ``act`` computes ("silu", "gelu_tanh"), or None."""
    if not callable(act):
        return None
    x = torch.linspace(-8.0, 8.0, 161)
    try:
        y = act(x)
    except Exception:  # an activation with parameters elsewhere, or not elementwise: no fused kernel
        return None
    for name, reference in _GLU_ACTIVATIONS.items():
        if isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y, reference(x), rtol=1e-5, atol=1e-6):
            return name
    return None


@contextlib.contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _random_stand_in(module: nn.Module) -> nn.Module:
    """A copy of a meta-device ``module`` on the CPU, its parameters and buffers random (seeded), for a probe."""
    stand_in = copy.deepcopy(module).to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in (*stand_in.parameters(), *stand_in.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
    return stand_in


def _probe_mlp(cls: type, module: nn.Module, spec: MlpSpec) -> str | None:
    """None if fuselm's gated MLP equals ``cls.forward`` on this module, else why it does not."""
    parameter = next(module.parameters(), None)
    if parameter is None:
        return "not probed: it has no weights (family not in fuselm's table)"
    if parameter.device.type == "meta":  # built on the meta device (FSDP2's init): probe a materialised stand-in
        module = _random_stand_in(module)
        parameter = next(module.parameters())
    first = getattr(module, spec.inputs[0])
    hidden = getattr(first, "in_features", None)
    if not isinstance(hidden, int):
        return "not probed: unknown input size (family not in fuselm's table)"
    dtype = parameter.dtype if parameter.is_floating_point() else torch.float32
    x = torch.randn(2, 3, hidden, generator=torch.Generator().manual_seed(0)).to(parameter.device, dtype)
    try:
        with torch.no_grad(), _eval_mode(module), use_backend("reference"):
            agree = _close(gated_mlp(module, spec, x), cls.forward(module, x))
    except Exception as error:  # foreign code on a probe input: not recognised
        return f"probe failed ({type(error).__name__}; family not in fuselm's table)"
    return None if agree else "forward differs from a gated MLP (family not in fuselm's table)"


@functools.cache
def _probe_rope(original: Callable) -> tuple[Callable | None, str]:
    """fuselm's drop-in for the HF function ``original``, or None and why not."""
    # transformers >= 5.25 with `kernels` installed wraps the function in a module (use_kernel_forward_from_hub),
    # called as before: its forward has the function's signature
    signed = original.forward if isinstance(original, torch.nn.Module) else original
    try:
        parameters = list(inspect.signature(signed).parameters)
    except (TypeError, ValueError):
        parameters = []
    if parameters != ["q", "k", "cos", "sin", "unsqueeze_dim"]:
        return None, f"{_ROPE_FUNCTION}({', '.join(parameters)}) has an unfamiliar signature"
    generator = torch.Generator().manual_seed(0)
    head_dim = 16
    q = torch.randn(2, 3, 5, head_dim, generator=generator)
    k = torch.randn(2, 2, 5, head_dim, generator=generator)
    cos = torch.randn(2, 5, head_dim, generator=generator)
    sin = torch.randn(2, 5, head_dim, generator=generator)
    agree = {}
    for rotary_dim in (head_dim, head_dim // 2):
        c, s = cos[..., :rotary_dim], sin[..., :rotary_dim]
        try:
            with torch.no_grad():
                expected = original(q, k, c, s)
        except Exception:  # e.g. Llama's function given a partial width: it never gets one
            agree[rotary_dim] = False
            continue
        got = rope_reference(q, k, c, s)
        agree[rotary_dim] = (isinstance(expected, tuple) and len(expected) == 2
                             and all(_close(e, g) for e, g in zip(expected, got)))
    if not agree[head_dim]:
        return None, f"{_ROPE_FUNCTION} does not compute rotate_half RoPE"
    return fused_apply_rotary_pos_emb(original, partial=agree[head_dim // 2]), ""


# ----------------------------------------------------------------------------------- recognition
class Recogniser:
    """Decides, per module, the fused class it gets or why it is left alone (a str). Caches per class."""

    def __init__(self, decoder_layer_needs_norms: bool):
        self.norm_specs: dict[tuple, NormSpec | None] = {}  # probes run once per class and settings
        self.mlp_verdicts: dict[tuple, str | None] = {}
        self.norms_enabled = decoder_layer_needs_norms

    def rms_norm(self, module: nn.Module) -> type | str:
        cls, family = type(module), family_of(type(module))
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not weight.is_floating_point():
            return "no 1-D floating-point weight"
        eps_attr = next((a for a in ("variance_epsilon", "eps") if isinstance(getattr(module, a, None), float)), None)
        if eps_attr is None:
            return "no float eps attribute (variance_epsilon or eps)"
        key = (cls, _settings(module))
        if key not in self.norm_specs:
            candidates = ((family.norm_casting, family.norm_offset),) if family else _NORM_ARITHMETIC
            try:
                self.norm_specs[key] = _probe_norm(cls, module, eps_attr, candidates)
            except Exception:  # foreign code on a probe input: not recognised
                self.norm_specs[key] = None
        spec = self.norm_specs[key]
        if spec is None:
            expected = (f"the table's {family.norm_casting} casting with offset {family.norm_offset}" if family
                        else f"any of fuselm's castings {CASTINGS} with offset 0 or 1")
            return f"{cls.__name__} does not compute {expected}"
        return fused_subclass(cls, FusedRMSNorm, _fuselm_norm=spec)

    def mlp(self, module: nn.Module) -> type | str:
        cls, family = type(module), family_of(type(module))
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module):
            count = len(experts) if isinstance(experts, nn.ModuleList) else getattr(experts, "num_experts", None)
            size = f" ({count} experts)" if isinstance(count, int) else ""
            return f"mixture-of-experts block{size}: experts left to HF"
        layout = family or _gated_layout(module)
        if layout is None or not all(isinstance(getattr(module, n, None), nn.Module)
                                     for n in (*layout.mlp_inputs, layout.mlp_output)):
            return "not a gated MLP (no gate/up/down projections)"
        act = getattr(module, layout.mlp_activation, None)
        activation = _probe_activation(act)
        if activation is None:
            return f"{_activation_name(module, layout, act)} has no fused kernel"
        spec = MlpSpec(layout.mlp_inputs, layout.mlp_output, activation)
        if family is None:
            key = (cls, spec, _settings(module))
            if key not in self.mlp_verdicts:
                self.mlp_verdicts[key] = _probe_mlp(cls, module, spec)
            if self.mlp_verdicts[key] is not None:
                return self.mlp_verdicts[key]
        return fused_subclass(cls, FusedGatedMLP, _fuselm_mlp=spec)

    def rope(self, module: nn.Module) -> type | str:
        return rope_class(type(module))

    def decoder_layer(self, module: nn.Module) -> type | str:
        cls, family = type(module), family_of(type(module))
        if family is None:
            return f"family {family_name(cls) or cls.__module__!r} is not in fuselm's table"
        if family.layer_norms == "post":
            return "its norms follow attention and MLP (post-norm): no residual add feeds a norm"
        if not self.norms_enabled:
            return "needs rms_norm=True"
        sandwich = family.layer_norms == "sandwich"
        names = ["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"]
        if sandwich:
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        names += list(family.residual_dropouts or ())
        missing = [name for name in names if not isinstance(getattr(module, name, None), nn.Module)]
        if missing:
            return f"no {missing[0]} submodule"
        fusion_norm = "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm"
        if not isinstance(getattr(module, fusion_norm), FusedRMSNorm):
            return f"its {fusion_norm} is not a fused RMSNorm"
        parameters = _parameters(cls.forward)
        if len(parameters) < 2 or parameters[1].name != "hidden_states":
            return "its forward does not take hidden_states first"
        positional = tuple(p.name for p in parameters[2:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        layer_defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
        required = [p.name for p in _parameters(type(module.self_attn).forward)[2:]
                    if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        attention_defaults = tuple((name, layer_defaults[name]) for name in required if name in layer_defaults)
        if not all(isinstance(default, _PLAIN) for _, default in attention_defaults):
            return "its forward has unfamiliar defaults for what self_attn requires"
        spec = LayerSpec(positional, attention_defaults, sandwich, family.residual_dropouts)
        return fused_subclass(cls, FusedDecoderLayer, _fuselm_layer=spec)

    def lora(self, module: nn.Module) -> type | str:
        reason = lora_unsupported_reason(module)
        return reason if reason is not None else fused_subclass(type(module), FusedLoraLinear)

    def loss(self, module: nn.Module) -> type | str:
        reason = loss_unsupported_reason(module)
        return reason if reason is not None else fused_causal_lm_class(type(module))


_PLAIN = (bool, int, float, str, type(None))


def lora_unsupported_reason(layer: nn.Module) -> str | None:
    """Why the PEFT LoRA ``layer`` cannot get the fused branch (None: it can); what can change per call (adapters
    disabled or merged, autocast, the backend) is decided per call by ``lora_call_args``."""
    base = getattr(layer, "base_layer", None)
    if not (type(base) is nn.Linear or _is_bnb_linear_4bit(type(base))):
        return f"its base layer is a {type(base).__name__}, not an nn.Linear or a bitsandbytes Linear4bit"
    names = [name for name in layer.active_adapters if name in layer.lora_A]
    if len(names) != 1:
        return f"{len(names)} active adapters (fused: exactly one)"
    name = names[0]
    dropout = layer.lora_dropout[name]
    if layer.use_dora.get(name):
        return "DoRA (use_dora=True)"
    if name in getattr(layer, "lora_variant", {}):
        return f"LoRA variant {type(layer.lora_variant[name]).__name__}"
    if layer.lora_B[name].bias is not None:
        return "lora_bias=True"
    if getattr(dropout, "p", 0.0) > 0:
        return f"lora_dropout={dropout.p} > 0 (PEFT's forward draws the dropout mask)"
    return None


def _is_bnb_linear_4bit(cls: type) -> bool:
    """bitsandbytes' ``Linear4bit`` (or a subclass, e.g. ``LinearNF4``), by name: bitsandbytes may be absent."""
    return any(c.__name__ == "Linear4bit" and c.__module__.startswith("bitsandbytes") for c in cls.__mro__)


def _settings(module: nn.Module) -> tuple:
    """The module's plain-valued public attributes (eps, sizes, flags): with its class, what a probe covers."""
    return tuple(sorted((name, value) for name, value in vars(module).items()
                        if not name.startswith("_") and isinstance(value, _PLAIN)))


def _parameters(method: Callable) -> list[inspect.Parameter]:
    return list(inspect.signature(inspect.unwrap(method)).parameters.values())


_GATED_LAYOUTS = (Family(), Family(mlp_inputs=("gate_up_proj",), mlp_activation="activation_fn"))


def _gated_layout(module: nn.Module) -> Family | None:
    """For a family not in the table: the first known gated-MLP attribute layout the module has."""
    for layout in _GATED_LAYOUTS:
        if all(hasattr(module, name) for name in (*layout.mlp_inputs, layout.mlp_output, layout.mlp_activation)):
            return layout
    return None


def _activation_name(module: nn.Module, layout: Family, act: object) -> str:
    config = getattr(module, "config", None)
    for key in (layout.activation_config, "hidden_act", "hidden_activation"):
        value = getattr(config, key, None)
        if isinstance(value, str):
            return f"{key} {value!r}"
    return f"activation {type(act).__name__}"



def rope_class(cls: type) -> type | str:
    """The fused subclass of attention class ``cls`` whose forward calls fuselm's rope, or why there is none."""
    forward = cls.forward
    raw = inspect.unwrap(forward)
    if not isinstance(raw, types.FunctionType) or _ROPE_FUNCTION not in raw.__code__.co_names:
        return f"its forward does not call {_ROPE_FUNCTION}"
    original = raw.__globals__.get(_ROPE_FUNCTION)
    if not callable(original):
        return f"{_ROPE_FUNCTION} is not a function in {raw.__module__}"
    fused, reason = _probe_rope(original)
    if fused is None:
        return reason
    subclass = fused_subclass(cls, make_forward=lambda: with_global(forward, _ROPE_FUNCTION, fused),
                              rebuild=(rope_class, (cls,)), _fuselm_rope=fused)
    return subclass if subclass is not None else "its forward is wrapped in an unfamiliar way"

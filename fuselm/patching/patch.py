"""``fuselm.patch(model)``: fused ops in one Hugging Face model instance, recognised by structure.

One generic path for every family: :mod:`~fuselm.patching.recognise` decides per module which fused
subclass (:mod:`~fuselm.patching.classes`) it gets, from its structure, a probe and the family table
(:mod:`~fuselm.patching.families`); :class:`~fuselm.patching.report.PatchReport` says what was done.

Nothing outside the model changes: no module globals, no attributes of HF classes. A subclass of a
``GradientCheckpointingLayer`` gets its forward wrapped for checkpointing by transformers itself
(>= 5.23 wraps ``forward`` when a class is created; older versions checkpoint in ``__call__``), so
gradient checkpointing keeps working.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from torch import nn

from fuselm.backend import path_name
from fuselm.ops.attention import HEAD_DIMS
from fuselm.patching.classes import ORIGINAL
from fuselm.patching.decode import ATTENTION_FACTS, decode_fallbacks, layer_facts
from fuselm.patching.families import family_of
from fuselm.patching.modules import NEXT_NORM, SHARES_INPUT_WITH, FusedDecoderLayer, FusedLoraLinear
from fuselm.patching.recognise import Recogniser, kind_of
from fuselm.patching.report import KindReport, PatchReport

# The kinds of module, patched phase by phase: a decoder layer fuses into the norms patched before it.
MODULE_PHASE = ("rms_norm", "rope", "mlp", "lora")
LAYER_PHASE = ("decoder_layer", "loss")
PHASES = (MODULE_PHASE, LAYER_PHASE)
KINDS = MODULE_PHASE + LAYER_PHASE


def patch(model: nn.Module, *, rms_norm: bool = True, rope: bool = True, mlp: bool = True,
          decoder_layer: bool = True, loss: bool = True, lora: bool = True) -> PatchReport:
    """Route this model instance's matching modules to fuselm's fused ops; returns what was done.

    Only ``model`` changes (its modules' classes; see :func:`unpatch`); patching twice is harmless
    (the second call starts from the unpatched model). Modules that are not recognised are left
    alone and listed in the report with the reason. Ops run Triton or the PyTorch reference per call
    (``FUSELM_BACKEND=reference`` runs the same patched model on the references).

    Args:
        model: a transformers model (``*ForCausalLM``, a base model, or a PEFT model around one),
            before or after ``peft.get_peft_model``.
        rms_norm: RMSNorm modules (including Qwen3/Gemma3 q_norm and k_norm) -> ``fuselm.rms_norm``.
        rope: the rotary embedding inside attention -> ``fuselm.rope``.
        mlp: gated MLPs (SiLU / tanh-GELU) -> ``fuselm.silu_mul`` / ``fuselm.gelu_tanh_mul``.
        decoder_layer: each residual add and the RMSNorm after it -> ``fuselm.add_rms_norm``
            (needs ``rms_norm``).
        loss: the ``*ForCausalLM`` training loss -> ``fuselm.linear_cross_entropy``, without the
            [tokens, vocab] logits (see :mod:`fuselm.patching.loss` for when it falls back to HF's).
        lora: PEFT LoRA layers (one active adapter, no dropout, no DoRA, around an ``nn.Linear`` or a bitsandbytes
            ``Linear4bit``) -> ``fuselm.lora_add`` after the base layer, on tensor cores without an fp32 copy of x;
            q/k/v and a fused MLP's gate/up share one read of x. Only layers that exist when ``patch`` runs: call
            it after ``peft.get_peft_model`` (patched before, the model trains on PEFT's own LoRA forward; patching
            again after ``get_peft_model`` adds the fusion).

    Training with HF ``Trainer`` or TRL ``SFTTrainer``, one line before building the trainer::

        model = AutoModelForCausalLM.from_pretrained(name)
        fuselm.patch(model)
        trainer = Trainer(model=model, args=args, train_dataset=data)  # or trl.SFTTrainer(...)

    (when the trainer loads the model itself, ``fuselm.patch(trainer.model)`` after building it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    unpatch(model)
    enabled = {"rms_norm": rms_norm, "rope": rope, "mlp": mlp, "decoder_layer": decoder_layer, "loss": loss,
               "lora": lora}
    kinds = {kind: KindReport() for kind in KINDS}
    recogniser = Recogniser(decoder_layer_needs_norms=rms_norm)
    for phase in PHASES:
        for module in model.modules():
            kind = kind_of(type(module))
            if kind not in phase:
                continue
            entry = kinds[kind]
            entry.total += 1
            if not enabled[kind]:
                entry.leave(f"disabled by {kind}=False")
                continue
            if "forward" in module.__dict__:
                entry.leave("forward replaced on the instance (e.g. by an accelerate hook)")
                continue
            try:
                fused = getattr(recogniser, kind)(module)
            except Exception as error:  # foreign module code fuselm cannot read: leave it, never crash
                fused = f"not recognised ({type(error).__name__}: {error})"
            if isinstance(fused, str):
                entry.leave(fused)
            else:
                module.__class__ = fused
                entry.patched += 1
    _link_next_norms(model)
    _link_shared_inputs(model)
    parameter = next(model.parameters(), None)
    ops_path = path_name(parameter.device) if parameter is not None else path_name("cpu")
    return PatchReport(type(model).__name__, ops_path, kinds, *_decode_paths(model))


def _decode_paths(model: nn.Module) -> tuple[dict[str, int], dict[str, int]]:
    """What the fused layers' decode steps run now: per projection name, how many call it as a module (not a plain
    linear); per reason, how many cannot run the fused kernels at all (HF's attention runs instead)."""
    calls: Counter[str] = Counter()
    unfused: Counter[str] = Counter()
    for module in model.modules():
        if not isinstance(module, FusedDecoderLayer):
            continue
        facts = layer_facts(module)
        if facts is None:
            unfused["its attention's config or layer index cannot be read"] += 1
        elif facts.head_dim not in HEAD_DIMS:
            unfused[f"head_dim {facts.head_dim} is not one decode attention supports {HEAD_DIMS}"] += 1
        else:
            calls.update(decode_fallbacks(module))
    return dict(calls), dict(unfused)


def unpatch(model: nn.Module) -> int:
    """Restore every module of ``model`` that :func:`patch` changed; returns how many were restored."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    restored = 0
    for module in model.modules():
        original = type(module).__dict__.get(ORIGINAL)
        if original is not None:
            module.__class__ = original
            restored += 1
        module.__dict__.pop(NEXT_NORM, None)
        module.__dict__.pop(SHARES_INPUT_WITH, None)
        module.__dict__.pop(ATTENTION_FACTS, None)
    return restored


@contextlib.contextmanager
def patched(model: nn.Module, **options: bool) -> Iterator[PatchReport]:
    """``with fuselm.patched(model) as report: ...``: :func:`patch` inside the block, unpatched after it."""
    report = patch(model, **options)
    try:
        yield report
    finally:
        unpatch(model)


def _link_next_norms(model: nn.Module) -> None:
    """Give each fused decoder layer the norm after it: the next layer's, or the model's final one.

    The link is the norm module itself, kept out of ``_modules``. Norms hold no reference back, so
    the link makes no reference cycle (``del model`` frees a patched model at once, as it does an
    unpatched one), and ``copy.deepcopy`` links a copy's layers to the copy's norms. A norm replaced
    after patching only loses the fusion: the layer then primes a norm that is never called with
    its output, and the new norm computes its own."""
    for parent in model.modules():
        for child in parent.children():
            if not isinstance(child, nn.ModuleList):
                continue
            layers = list(child)
            for i, layer in enumerate(layers):
                if not isinstance(layer, FusedDecoderLayer):
                    continue
                owner, attribute = ((layers[i + 1], "input_layernorm") if i + 1 < len(layers)
                                    else (parent, family_of(type(layer)).final_norm))
                layer.__dict__[NEXT_NORM] = getattr(owner, attribute, None)


_QKV = ("q_proj", "k_proj", "v_proj")  # in the order HF's attention forwards call them (every family in the table)


def _link_shared_inputs(model: nn.Module) -> None:
    """Give the first fused LoRA layer among each module's q/k/v projections the others, which it computes with
    its own output from one read of their shared input (see :class:`FusedLoraLinear`). Plain attributes, kept out
    of ``_modules``, as the next-norm links are."""
    for module in model.modules():
        layers = [getattr(module, name, None) for name in _QKV]
        fused = [layer for layer in layers if isinstance(layer, FusedLoraLinear)]
        if len(fused) > 1:
            fused[0].__dict__[SHARES_INPUT_WITH] = tuple(fused[1:])

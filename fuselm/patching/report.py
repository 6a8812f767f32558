"""What :func:`fuselm.patch` did: per kind of module, how many it patched and why it left the others alone."""

from __future__ import annotations

from dataclasses import dataclass, field

_LISTED_WHEN_PRESENT = ("lora",)  # kinds that most models lack: printed only when the model has some


@dataclass
class KindReport:
    """Modules of one kind: how many there are, how many were patched, why the others were left alone."""

    patched: int = 0
    total: int = 0
    left_alone: dict[str, int] = field(default_factory=dict)  # reason -> number of modules

    def leave(self, reason: str) -> None:
        self.left_alone[reason] = self.left_alone.get(reason, 0) + 1


@dataclass
class PatchReport:
    """What :func:`patch` did, per kind of module (``report["mlp"].patched``); ``print`` it to read it."""

    model: str
    ops_path: str
    kinds: dict[str, KindReport]
    # projection name (or self_attn) -> fused decoder layers whose decode step calls it as a module (LoRA,
    # quantised, hooked)
    decode_module_calls: dict[str, int] = field(default_factory=dict)
    # reason -> fused decoder layers whose decode step cannot run the fused kernels (HF's attention runs instead)
    decode_unfused: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, kind: str) -> KindReport:
        return self.kinds[kind]

    def __str__(self) -> str:
        """One line per kind, ``patched/total``, and under it one line per reason, its count first."""
        lines = [f"fuselm.patch({self.model}) — ops: {self.ops_path}"]
        if not any(entry.total for entry in self.kinds.values()):
            lines.append("  nothing recognised: no module is named like an HF RMSNorm, Attention, MLP, "
                         "DecoderLayer or ForCausalLM")
            return "\n".join(lines)
        width = max(len(kind) for kind in self.kinds) + 1
        for kind, entry in self.kinds.items():
            if kind in _LISTED_WHEN_PRESENT and not entry.total:
                continue
            lines.append(f"  {kind + ':':<{width}} {entry.patched}/{entry.total}")
            lines += [f"  {'':<{width}}   {n} × {reason}" for reason, n in entry.left_alone.items()]
        if not any(entry.patched for entry in self.kinds.values()):
            lines.append("  nothing patched")
        layers = self.kinds.get("decoder_layer")
        if layers is not None and layers.patched:
            how = ("HF's attention over fuselm's KV cache, no fused kernels"
                   if sum(self.decode_unfused.values()) >= layers.patched
                   else "fused kernels over fuselm's KV cache (FusedKVCache)")
            lines.append(f"  {'decode step:':<{width}} {how}")
            lines += [f"  {'':<{width}}   {n} × layer runs HF's attention: {reason}"
                      for reason, n in self.decode_unfused.items()]
            lines += [f"  {'':<{width}}   {n} × {name} runs as its module (hooked, or not a plain nn.Linear: LoRA, "
                      "quantised)" for name, n in self.decode_module_calls.items()]
        return "\n".join(lines)

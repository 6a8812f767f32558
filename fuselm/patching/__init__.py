"""Model patching: ``fuselm.patch(model)`` puts fuselm's fused ops into one Hugging Face model instance."""

from fuselm.patching.patch import KindReport, PatchReport, patch, patched, unpatch

__all__ = ["patch", "unpatch", "patched", "PatchReport", "KindReport"]

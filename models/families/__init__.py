"""Model families: one home per Hugging Face family kvforge knows (family.py says what a family is and which
export stage asks each of its hooks; registry.py holds the one table; a family that needs code has a module
here; surgery.py holds the helpers they share)."""

from kvforge.models.families.family import SUPPORTED_ROPE_TYPES, Family, LoopedExperts
from kvforge.models.families.registry import (
    HAND_WRITTEN,
    LOGIT_KEYS,
    families,
    family_for,
    family_modules,
    logit_keys,
    own_text_type,
    support_table,
    supported_architectures,
    trial_registry,
)

__all__ = ["HAND_WRITTEN", "LOGIT_KEYS", "SUPPORTED_ROPE_TYPES", "Family", "LoopedExperts", "families", "family_for",
           "family_modules", "logit_keys", "own_text_type", "support_table", "supported_architectures",
           "trial_registry"]

"""Phi-4-multimodal: a Phi-3 decoder whose image and audio towers sit inside its embedding
(model.embed_tokens_extend). Its config is its own text config (no `text_config`): the text model is Phi-3's,
made from the fields Phi-3's config has (exporter/text_model.py)."""

from __future__ import annotations

from kvforge.models.families.family import Family

FAMILIES = (Family("phi4_multimodal", (), "a Phi-3 decoder; its text model exported", text_config="phi3"),)

"""Gemma 3 (Gemma3ForConditionalGeneration) exported whole: its SigLIP tower and projector as vision.onnx, its text
model (gemma3_text, a hand-written family in registry.py) as prefill and decode.

What differs from the LLaVA-like families (models/vision_families.py holds its row):
- the prompt: Gemma3Processor replaces each "<start_of_image>" of a text with "\\n\\n<start_of_image>", its
  mm_tokens_per_image "<image_soft_token>"s, "<end_of_image>\\n\\n", then tokenizes the whole text. The special
  tokens split it, so the ids are those of the text before with "\\n\\n" appended, <start_of_image>, the soft tokens,
  <end_of_image>, and the text after with "\\n\\n" in front (IMAGE_TEXT_BEFORE / IMAGE_TEXT_AFTER: the runtime adds
  them to the text pieces before it tokenizes them, runtime/media/image_prompt.py);
- the attention: an image's soft tokens attend to each other both ways in prefill (the fused op's block ids,
  exporter/image_blocks.py), as Hugging Face does when the processor's token_type_ids are passed;
- the image processor: Gemma3ImageProcessor resizes to a fixed size, rescales and normalises (the runtime's
  pipeline); its pan-and-scan crops are refused.
"""

from __future__ import annotations

from typing import Any

from kvforge.core.errors import UnsupportedModelError

MODEL_TYPE = "gemma3"
PLACEHOLDER = "<start_of_image>"  # what a prompt and the chat template write for an image (the processor's boi token)
BEFORE = ("<start_of_image>",)
AFTER = ("<end_of_image>",)
IMAGE_TEXT_BEFORE = "\n\n"
IMAGE_TEXT_AFTER = "\n\n"

FAMILIES: tuple = ()  # the text model's family is registry.py's gemma3_text


def image_features(model: Any, pixel_values: Any) -> Any:
    """[mm_tokens_per_image, hidden]: transformers' get_image_features (SigLIP's last hidden state, average-pooled
    to the image's soft tokens, RMS-normed and projected), image tokens in prompt order."""
    out = model.model.get_image_features(pixel_values=pixel_values, return_dict=True).pooler_output
    return out.reshape(-1, out.shape[-1])


def refuse_pan_and_scan(record: dict[str, Any], where: str) -> None:
    """Pan and scan adds crops of a long image (each its own run of soft tokens, in a text of its own), which the
    vision graph's one image per call does not make: refused at export (and by the runtime)."""
    if record.get("do_pan_and_scan"):
        raise UnsupportedModelError(f"{where}: its image processor sets do_pan_and_scan, whose extra crops kvforge's "
                                    "image path does not make: set \"do_pan_and_scan\": false in its processor config, "
                                    "or export with --text-only")

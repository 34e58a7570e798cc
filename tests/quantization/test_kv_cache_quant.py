"""`kvforge export --kv-cache int8`: ONNX Runtime's GroupQueryAttention keeps an int8 KV cache with
per-channel scales calibrated at export (exporter/quantization/kv_cache.py). One tiny Llama export, checked against
the fp32-cache export and Hugging Face eager; the refusal for targets without a quantised cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.core.contract import KVLayout, cache_input, cache_output
from kvforge.core.errors import InputError
from kvforge.core.manifest import io_entry, load_manifest

pytest.importorskip("torch")

PROMPT = [1, 17, 230, 45, 99, 3, 310, 77, 12, 450, 8, 61]
NEW = 12
# The tiny Llama's logits span about -7..6 on this prompt; its int8 cache moves them by 0.03-0.33 per step
# (measured), a cache read with wrong scales or channels by whole units.
LOGIT_ATOL = 0.5


@pytest.fixture(scope="module")
def int8_export(hf_folder, tmp_path_factory) -> tuple:
    """The tiny Llama exported through the CLI with --kv-cache int8 (which also measures its accuracy)."""
    out = tmp_path_factory.mktemp("kvq") / "llama-int8kv"
    result = CliRunner().invoke(main, ["export", str(hf_folder("llama-tiny")), "-o", str(out), "--kv-cache", "int8",
                                       "--json"])
    assert result.exit_code == 0, result.output
    return out, json.loads(result.output[result.output.index("{"):])


def _logits(folder, prompt=PROMPT) -> tuple[list[int], np.ndarray]:
    from kvforge.runtime import GenerationRequest, Generator

    result = Generator(folder).generate(GenerationRequest([prompt], NEW, ignore_eos=True, keep_logits=True))
    return result.tokens[0], np.stack([step[0] for step in result.logits])


def test_manifest_records_the_int8_cache_and_its_calibration(int8_export) -> None:
    out, printed = int8_export
    manifest = load_manifest(out)
    layout = KVLayout.from_manifest(manifest)
    assert layout.dtype == "int8"
    assert layout.bytes(1, 64) == 2 * layout.num_layers * layout.num_kv_heads * 64 * layout.head_dim  # 1 byte each
    quant = manifest["kv_cache_quantization"]
    assert quant["dtype"] == "int8" and quant["scales"] == "per_channel"
    assert quant["scale_shape"] == [1, layout.num_kv_heads, 1, layout.head_dim]
    # Calibrated on the text after the 1024 tokens parity scores, so the measured perplexity is held out.
    assert quant["calibration"]["text"] == "perplexity.txt" and quant["calibration"]["first_token"] == 1024
    assert quant["calibration"]["tokens"] == 2048
    for phase in ("prefill", "decode"):
        for layer in range(layout.num_layers):
            for kind in ("key", "value"):
                assert io_entry(manifest, phase, cache_input(kind, layer))["dtype"] == "int8"
                assert io_entry(manifest, phase, cache_output(kind, layer))["dtype"] == "int8"
    # The CLI measured what the int8 cache costs (perplexity gate of an 8-bit export, see kvforge.tools.parity).
    accuracy = printed["manifest"]["kv_cache_quantization"]["accuracy"]
    assert abs(accuracy["perplexity_relative_increase"]) < 0.02, accuracy
    assert load_manifest(out)["kv_cache_quantization"]["accuracy"] == accuracy


def test_int8_cache_logits_close_to_the_fp32_cache_and_hf_eager(int8_export, exported, hf_folder) -> None:
    import torch

    from kvforge.exporter.load import load_hf_model

    tokens, logits = _logits(int8_export[0])
    fp32_tokens, fp32_logits = _logits(exported("llama-tiny"))
    same = next((i for i, (a, b) in enumerate(zip(tokens, fp32_tokens, strict=True)) if a != b), NEW)
    # Up to the first differing token both saw the same history: compare those steps with the fp32 cache.
    err_fp32 = np.abs(logits[: same + 1] - fp32_logits[: same + 1]).max()
    assert 0 < err_fp32 < LOGIT_ATOL, err_fp32  # not bit-equal: the cache really is quantised
    # Hugging Face eager scores prompt + the int8 export's own tokens (teacher-forced), every step.
    model = load_hf_model(hf_folder("llama-tiny"), "fp32")
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1 :].numpy()
    err_hf = np.abs(logits - ref).max()
    assert err_hf < LOGIT_ATOL, err_hf
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_int8_cache_holds_the_fp32_cache_rounded_to_its_scales(int8_export, exported) -> None:
    """Layer 0's in-place int8 buffers (its keys and values depend on the prompt alone; later layers see
    the quantised attention of earlier ones), times the graph's scales, are the fp32 export's cache
    within half a step (symmetric round-to-nearest) at every written position, or saturated at the
    int8 range where the value lies beyond the calibrated one."""
    import onnx_ir as ir

    from kvforge.runtime import GenerationRequest, Generator

    out = int8_export[0]
    request = GenerationRequest([PROMPT], 2, ignore_eos=True)
    caches = {}
    for name, folder in (("int8", out), ("fp32", exported("llama-tiny"))):
        gen = Generator(folder)
        gen.generate(request)
        slot = gen.slots.last
        caches[name] = [gen.backend.read_kv(slot, layer) for layer in range(gen.backend.num_layers)]
    assert caches["int8"][0][0].dtype == np.int8
    # The scales are constants of the graph: each attention node's k_scale / v_scale inputs.
    graph = ir.load(out / "prefill.onnx").graph
    nodes = [node for node in graph if node.domain == "com.microsoft" and node.op_type == "GroupQueryAttention"]
    written = len(PROMPT) + 1  # the prompt and the first generated token (the last one is never fed back)
    assert len(nodes) == len(caches["int8"])
    for node in nodes:
        assert node.attributes["k_quant_type"].value == "PER_CHANNEL" and node.attributes["kv_cache_bit_width"].value == 8
    first = next(node for node in nodes if node.inputs[3].name == cache_input("key", 0))
    for kind, scale_input in ((0, first.inputs[12]), (1, first.inputs[13])):
        scale = (scale_input.const_value or scale_input.producer().attributes["value"].value).numpy()
        assert scale.shape == (1, caches["int8"][0][kind].shape[1], 1, caches["int8"][0][kind].shape[3])
        stored = caches["int8"][0][kind][:, :, :written].astype(np.float32)
        exact = caches["fp32"][0][kind][:, :, :written] / scale
        rounded = np.abs(stored - exact) <= 0.5 + 1e-4
        saturated = ((stored == 127) & (exact > 127)) | ((stored == -128) & (exact < -128))
        assert np.all(rounded | saturated), kind
        assert np.abs(stored).max() > 64  # the scales use the int8 range


@pytest.mark.parametrize("target", ["onnx", "trt"])
def test_targets_without_a_quantised_cache_refuse_it(target, tmp_path) -> None:
    from kvforge.exporter.export import ExportOptions

    with pytest.raises(InputError, match=f"--kv-cache int8: the {target} target's attention .* has no quantised "
                                         "cache; use --target ort"):
        ExportOptions(target=target, kv_cache="int8").resolve()
    result = CliRunner().invoke(main, ["export", str(tmp_path), "-o", str(tmp_path / "out"), "--target", target,
                                       "--kv-cache", "int8"])
    assert result.exit_code == 2 and "use --target ort" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_other_dtypes_are_refused_with_the_int8_cache() -> None:
    from kvforge.exporter.export import ExportOptions

    with pytest.raises(InputError, match="--kv-cache int8 is measured with fp32 activations only; drop --dtype fp16"):
        ExportOptions(kv_cache="int8", dtype="fp16").resolve()
    with pytest.raises(InputError, match="--kv-cache takes int8, not 'int4'"):
        ExportOptions(kv_cache="int4").resolve()


def test_rotary_pairs_share_a_norm_scale_that_no_rotation_leaves() -> None:
    """A key channel pair (i, i + R/2) that RoPE rotates keeps its norm: scales from the pair norm hold the
    keys at any position, where per-channel maxima of the calibration positions would clip."""
    from kvforge.exporter.quantization.kv_cache import channel_scales

    rng = np.random.default_rng(0)
    head_dim, rotary = 8, 8
    keys = rng.standard_normal((200, 1, head_dim)).astype(np.float32)
    keys[:, :, 3] *= 0.01  # a channel small at the calibration positions, large once its partner rotates in
    scales = channel_scales(keys, 127, rotary)[0, :, 0, :]
    assert np.array_equal(scales[:, :4], scales[:, 4:])
    half = rotary // 2
    for angle in np.linspace(0, 2 * np.pi, 13):
        rotated = keys.copy()
        cos, sin = np.cos(angle), np.sin(angle)
        rotated[..., :half] = keys[..., :half] * cos - keys[..., half:] * sin
        rotated[..., half:] = keys[..., half:] * cos + keys[..., :half] * sin
        assert np.all(np.abs(rotated) <= 127 * scales + 1e-6)
    plain = channel_scales(keys, 127)[0, :, 0, :]  # no rotary: per-channel maxima
    assert np.allclose(plain[0], np.abs(keys).max(axis=0)[0] / 127)

"""Gemma 3 exported whole (kvforge/tools/vlm_fixtures.py TINY_VLMS["gemma3"]): vision.onnx against Hugging Face's
image features; one and two images against HF `generate` given the processor's token_type_ids (an image's soft tokens
attend to each other both ways: the fused op's block ids, exporter/image_blocks.py) on `ort` and `onnx`, logits at
every step; a batch; text-only; chunked prefill that keeps blocks whole; and the op's block semantics on its own."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_vision_language import scheduled_turn  # noqa: E402
from vlm_testing import rgb_image  # noqa: E402

from kvforge.tools.vlm_fixtures import IMAGE_TOKEN_ID, build_tiny_vlm  # noqa: E402

NEW_TOKENS = 32
TARGETS = ("ort", "onnx")
pytestmark = pytest.mark.xdist_group("gemma3-vision")  # its exports made once, on one worker



class Gemma3:
    """The tiny checkpoint, its fp32 exports per target, HF's model and Gemma3Processor, and a Generator per target."""

    def __init__(self, root) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor

        from kvforge.exporter.export import export_model
        from kvforge.runtime import Generator

        self.hf_dir = root / "gemma3"
        self.model = build_tiny_vlm("gemma3", self.hf_dir)
        self.manifests = {t: export_model(self.hf_dir, root / t, target=t) for t in TARGETS}
        self.folders = {t: root / t for t in TARGETS}
        self.gens = {t: Generator(root / t) for t in TARGETS}
        self.vision = self.manifests["ort"]["vision"]
        self.tokenizer = AutoTokenizer.from_pretrained(self.hf_dir, extra_special_tokens={
            "image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"})
        self.processor = Gemma3Processor(AutoImageProcessor.from_pretrained(self.hf_dir), self.tokenizer,
                                         image_seq_length=self.model.config.mm_tokens_per_image)

    def hf_inputs(self, prompt: str, images: list) -> dict:
        return dict(self.processor(text=[prompt], images=[images] if images else None, return_tensors="pt"))

    def hf_greedy(self, inputs: dict, new: int) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def g3(tmp_path_factory) -> Gemma3:
    return Gemma3(tmp_path_factory.mktemp("gemma3"))


def test_vision_graph_matches_hf_image_features(g3):
    from kvforge.models.vision_families import VISION_FAMILIES
    from kvforge.runtime.backends.vision_encoder import VisionEncoder
    from kvforge.runtime.media.preprocess import preprocess

    encoder = VisionEncoder(g3.folders["ort"], g3.manifests["ort"])
    for seed, (height, width) in enumerate(((70, 90), (120, 60))):
        image = rgb_image(seed, height, width)
        pixels = g3.hf_inputs("<start_of_image>", [image])["pixel_values"]
        np.testing.assert_allclose(preprocess(image, g3.vision["processor"]), pixels[0].numpy(), atol=1e-6, rtol=0)
        with torch.no_grad():
            want = VISION_FAMILIES["gemma3"].features(g3.model, pixels).numpy()
        got = encoder.encode(pixels[0].numpy())
        assert got.shape == want.shape == (16, g3.vision["hidden_size"])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("images", [1, 2])
def test_images_match_hf_generate_and_logits_at_every_step(g3, target, images):
    from kvforge.runtime.media.image_prompt import expand_images, text_with_images

    pictures = [rgb_image(10 + i, 80 + 20 * i, 100 - 10 * i) for i in range(images)]
    prompt = "Describe <start_of_image> in a few words" + (" and compare it with <start_of_image>" if images == 2 else "")
    inputs = g3.hf_inputs(prompt, pictures)
    ids = inputs["input_ids"][0].tolist()
    # The runtime's prompt is the processor's, id for id ("\n\n" tokenized with the text around each image).
    encode = lambda text, special: g3.tokenizer(text, add_special_tokens=special)["input_ids"]  # noqa: E731
    assert expand_images(text_with_images(prompt, g3.vision, encode), images, g3.vision, "prompt") == ids
    result = g3.gens[target].generate(prompt, images=pictures, max_new_tokens=NEW_TOKENS, greedy=True,
                                      ignore_eos=True, keep_logits=True)
    assert result.tokens[0] == g3.hf_greedy(inputs, NEW_TOKENS)
    full_ids = torch.tensor([ids + result.tokens[0]])
    types = torch.cat([inputs["token_type_ids"], torch.zeros(1, NEW_TOKENS, dtype=torch.int64)], 1)
    with torch.no_grad():  # teacher-forced, with the image blocks seen both ways as generate sees them
        full = g3.model(input_ids=full_ids, pixel_values=inputs["pixel_values"], token_type_ids=types).logits[0]
        causal = g3.model(input_ids=full_ids, pixel_values=inputs["pixel_values"]).logits[0]
    steps = np.stack([np.asarray(step)[0] for step in result.logits])
    window = slice(len(ids) - 1, len(ids) - 1 + len(steps))
    np.testing.assert_allclose(steps, full[window].numpy(), atol=1e-3, rtol=0)
    assert np.abs(steps - causal[window].numpy()).max() > 1e-2  # the blocks matter: a causal export would fail


def test_a_rendered_chat_gets_the_processors_ids(g3):
    """A chat template writes "<start_of_image>" after "user\n": the processor's "\n\n" then joins that newline
    ("\n\n\n" tokenized as one piece), and so does the runtime's chat path (images_around)."""
    from kvforge.runtime.media.image_prompt import expand_images, images_around

    text = "<start_of_turn>user\n<start_of_image>What is it?\n\n<start_of_image><end_of_turn>\n<start_of_turn>model\n"
    pictures = [rgb_image(1, 50, 60), rgb_image(2, 60, 50)]
    want = g3.processor(text=[text], images=[pictures], add_special_tokens=False)["input_ids"][0]
    encode = images_around(g3.vision, lambda piece: g3.tokenizer(piece, add_special_tokens=False)["input_ids"])
    assert expand_images(encode(text), 2, g3.vision, "chat") == list(want)


def test_a_batch_of_two_prompts_with_different_images_equals_each_alone(g3):
    gen = g3.gens["ort"]
    pictures = [rgb_image(5, 64, 128), rgb_image(6, 140, 70)]
    prompts = ["<start_of_image> What is this?", "Look at it: <start_of_image> and say what it shows, please"]
    batch = gen.generate(prompts, images=[[pictures[0]], [pictures[1]]], max_new_tokens=16, greedy=True,
                         ignore_eos=True)
    for i, prompt in enumerate(prompts):
        alone = gen.generate(prompt, images=[pictures[i]], max_new_tokens=16, greedy=True, ignore_eos=True)
        assert batch.tokens[i] == alone.tokens[0] == g3.hf_greedy(g3.hf_inputs(prompt, [pictures[i]]), 16)
    assert batch.tokens[0] != batch.tokens[1]


def test_text_only_equals_hf_text_model(g3):
    inputs = g3.hf_inputs("Once upon a time", [])
    for target in TARGETS:
        result = g3.gens[target].generate("Once upon a time", max_new_tokens=16, greedy=True, ignore_eos=True)
        assert result.tokens[0] == g3.hf_greedy({"input_ids": inputs["input_ids"]}, 16)


def test_chunked_prefill_and_prefix_reuse_keep_image_blocks_whole(g3):
    """The scheduler's chunks of 8 tokens would cut the 16-token block; the runtime moves the cut to its edge, and a
    second turn's reused prefix ends before an image or after it, never inside. Both equal the Generator's answer."""
    from kvforge.runtime.drivers.image_blocks import chunk_end, prefix_end
    from kvforge.runtime.drivers.scheduler import Scheduler

    t = IMAGE_TOKEN_ID
    ids = [1, 2, 3, t, t, t, t, 4, 5]
    assert [chunk_end(ids, 0, end, t) for end in range(1, 10)] == [1, 2, 3, 3, 3, 3, 7, 8, 9]
    assert chunk_end(ids, 3, 5, t) == 7 and chunk_end(ids, 0, 5, None) == 5  # a run longer than the call: whole
    assert [prefix_end(ids, n, t) for n in range(9)] == [0, 1, 2, 3, 3, 3, 3, 7, 8]
    gen, image = g3.gens["ort"], rgb_image(21, 90, 70)
    scheduler = Scheduler(gen.export, max_batch=2, max_seq_len=256, prefill_chunk=8).start()
    try:
        for prompt in ("Look: <start_of_image> What is it?", "Look: <start_of_image> What is it? And the colours?"):
            tokens, _ = scheduled_turn(scheduler, gen, prompt, image)
            alone = gen.generate(prompt, images=[image], max_new_tokens=8, greedy=True, ignore_eos=True)
            assert tokens == alone.tokens[0]
    finally:
        scheduler.close()


def test_refusals(g3):
    import json
    import shutil

    from kvforge.core.errors import InputError, ManifestError, UnsupportedModelError
    from kvforge.exporter.export import export_model
    from kvforge.models.families.gemma3 import refuse_pan_and_scan
    from kvforge.runtime import Generator
    from kvforge.runtime.media.preprocess import check_processor

    with pytest.raises(UnsupportedModelError, match="takes no images"):
        export_model(g3.hf_dir, g3.hf_dir.parent / "trt", target="trt")
    with pytest.raises(UnsupportedModelError, match="do_pan_and_scan"):
        refuse_pan_and_scan({"do_pan_and_scan": True}, "gemma3")
    with pytest.raises(InputError, match="do_pan_and_scan"):
        check_processor({**g3.vision["processor"], "do_pan_and_scan": True})
    folder = g3.hf_dir.parent / "tampered"  # a manifest whose image_blocks was tampered with is refused on load
    shutil.copytree(g3.folders["ort"], folder)
    manifest = json.loads((folder / "kvforge.json").read_text())
    manifest["vision"]["image_blocks"] = "yes"
    (folder / "kvforge.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="image_blocks"):
        Generator(folder)


def test_the_graphs_have_blocks_in_prefill_only(g3):
    """gemma3's prefill lowers attention to TensorScatter + Attention with the block mask (both targets); its decode
    keeps the causal op (GroupQueryAttention on `ort`) and computes no block ids."""
    for target, manifest in g3.manifests.items():
        prefill, decode = (manifest["graphs"][phase]["op_counts"] for phase in ("prefill", "decode"))
        assert prefill.get("CumSum") and not decode.get("CumSum"), target
        assert prefill.get("Attention") == 2
    assert g3.manifests["ort"]["graphs"]["decode"]["op_counts"].get("com.microsoft.GroupQueryAttention") == 2


def _masked_softmax_attention(q, k, v, allowed):
    """Plain attention over [B, H, S, D] with a boolean [B, S, S] mask (one head per kv head)."""
    scores = torch.einsum("bhsd,bhtd->bhst", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhst,bhtd->bhsd", torch.softmax(scores, -1), v)


@pytest.mark.parametrize("window", [0, 3])
def test_reference_op_is_bidirectional_inside_a_block_and_causal_elsewhere(window):
    from kvforge.core.contract import AttentionAttrs
    from kvforge.exporter.image_blocks import block_ids_of
    from kvforge.plugins import numpy_reference, reference

    torch.manual_seed(0)
    b, h, s, d, capacity = 2, 2, 10, 8, 16
    ids = torch.tensor([[5, 9, 9, 9, 9, 6, 9, 9, 7, 8], [9, 9, 9, 1, 2, 3, 4, 9, 9, 5]])
    blocks = block_ids_of(ids, 9)
    assert blocks.tolist() == [[0, 1, 1, 1, 1, 0, 2, 2, 0, 0], [1, 1, 1, 0, 0, 0, 0, 2, 2, 0]]
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    flat = [x.transpose(1, 2).reshape(b, s, h * d) for x in (q, k, v)]
    attrs = AttentionAttrs(h, h, d ** -0.5, 0.0, window)
    cache = torch.zeros(b, h, capacity, d)
    pos = torch.arange(s)
    allowed = (pos[None, :, None] >= pos[None, None, :]) | (
        (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] > 0))
    if window:
        allowed &= pos[None, None, :] > pos[None, :, None] - window
    want = _masked_softmax_attention(q, k, v, allowed).transpose(1, 2).reshape(b, s, h * d)
    lens = torch.zeros(b, dtype=torch.int32)
    out, _, _ = reference.kv_cache_attention(*flat, cache, cache.clone(), lens, attrs, block_ids=blocks)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    causal, _, _ = reference.kv_cache_attention(*flat, cache, cache.clone(), lens, attrs)
    assert (out - causal).abs().max() > 1e-2
    got = numpy_reference.kv_cache_attention_(*(x.numpy() for x in flat), cache.numpy().copy(), cache.numpy().copy(),
                                              lens.numpy(), attrs, block_ids=blocks.numpy())
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=0)
    # After a cached prefix, blocks cover this call's tokens only: a block at the call's start sees its later tokens.
    half, past = s // 2, torch.zeros(b, h, capacity, d)
    _, pk, pv = reference.kv_cache_attention(*(x[:, :half] for x in flat), past, past.clone(), lens, attrs)
    blocks2 = torch.tensor([[0, 3, 3, 3, 0]] * b)
    allowed2 = allowed.clone()[:, half:, :]
    allowed2[:] = pos[None, half:, None] >= pos[None, None, :]
    allowed2[:, 1:4, half + 1:half + 4] = True
    if window:
        allowed2 &= pos[None, None, :] > pos[None, half:, None] - window
    want2 = _masked_softmax_attention(q[:, :, half:], k, v, allowed2).transpose(1, 2).reshape(b, half, h * d)
    out2, _, _ = reference.kv_cache_attention(*(x[:, half:] for x in flat), pk, pv, lens + half, attrs,
                                              block_ids=blocks2)
    torch.testing.assert_close(out2, want2, atol=1e-5, rtol=0)


def test_a_causal_family_has_no_block_ids(tmp_path):
    """llava's tiny export: no image blocks, so its graphs keep GroupQueryAttention and compute no block ids (the
    canonical node is as before; the helper's report compares the graphs' bytes with the previous commit's)."""
    from kvforge.exporter.export import export_model
    from kvforge.exporter.image_blocks import bidirectional_images
    from kvforge.exporter.load import load_hf_config
    from kvforge.exporter.text_model import text_of
    from kvforge.tools.vlm_fixtures import tiny_vlm_config

    build_tiny_vlm("llava", tmp_path / "hf")
    manifest = export_model(tmp_path / "hf", tmp_path / "out")
    layers = tiny_vlm_config("llava").text_config.num_hidden_layers
    for phase in ("prefill", "decode"):
        ops = manifest["graphs"][phase]["op_counts"]
        assert ops.get("com.microsoft.GroupQueryAttention") == layers, phase
        assert not ops.get("Attention") and not ops.get("TensorScatter"), phase
    assert "image_blocks" not in manifest["vision"] and "text_before" not in manifest["vision"]
    text = load_hf_config(tmp_path / "hf", None)
    assert text_of(text)["model_type"] == "llava" and not bidirectional_images(text)

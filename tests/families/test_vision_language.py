"""Vision-language exports, per family (kvforge/tools/vlm_fixtures.py TINY_VLMS): vision.onnx against Hugging Face's
image features, prefill with an image against HF's logits at every step, 32 greedy tokens, a batch of two prompts
with different images and lengths, a second turn about the same image, and text-only requests unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvforge.models.vision_families import VISION_FAMILIES  # noqa: E402
from kvforge.tools.vlm_fixtures import TINY_VLMS, build_tiny_vlm  # noqa: E402

# Families of one fixed-size image per place; those whose images take tokens by their size (Qwen-VL), are tiled
# (test_tiled_vision.py, ...) and the rows not exported whole yet are tested in their own files (test_qwen_vl.py;
# Gemma 3, whose image tokens attend both ways: test_gemma3_vision.py).
FAMILIES = sorted(name for name in TINY_VLMS if name in VISION_FAMILIES and not VISION_FAMILIES[name].patches
                  and not VISION_FAMILIES[name].bidirectional_images and not VISION_FAMILIES[name].tiling)
NEW_TOKENS = 32
# One worker takes every test here (pytest-xdist --dist loadgroup): each family's checkpoint and export are made once.
pytestmark = pytest.mark.xdist_group("vision-language")


def _image(seed: int, height: int, width: int, mode: str = "RGB"):
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 4) * 255).astype(np.uint8), "RGBA").convert(mode)


class Exported:
    """A family's tiny checkpoint, its fp32 export, the HF model and processor, and a Generator over it."""

    def __init__(self, family: str, root: Path) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        from kvforge.exporter.export import export_model
        from kvforge.runtime import Generator

        self.family, self.hf_dir, self.out = family, root / family, root / f"{family}.export"
        self.model = build_tiny_vlm(family, self.hf_dir)
        self.manifest = export_model(self.hf_dir, self.out)
        self.vision = self.manifest["vision"]
        self.processor = AutoImageProcessor.from_pretrained(self.hf_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        self.gen = Generator(self.out)

    def hf_ids(self, before: str, after: str, images: int = 1) -> list[int]:
        """The ids HF's processor makes of `before<image>after` (the image's run as the family expands it)."""
        run = [*self.vision["before_ids"], *[self.vision["image_token_id"]] * self.vision["tokens_per_image"],
               *self.vision["after_ids"]]
        ids = self.tokenizer(before)["input_ids"] + run * images
        return ids + (self.tokenizer(after, add_special_tokens=False)["input_ids"] if after else [])

    def pixels(self, *images) -> torch.Tensor:
        out = self.processor(images=list(images), return_tensors="np")
        return torch.from_numpy(out["pixel_values"] if "pixel_values" in out else out["pixel_values_images"])

    def hf_greedy(self, ids: list[int], pixels: torch.Tensor | None, new: int = NEW_TOKENS) -> list[int]:
        images = {} if pixels is None else {"pixel_values": pixels}
        with torch.no_grad():
            out = self.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new,
                                      do_sample=False, **images)
        return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(family) -> its Exported, made once: the per-family tests and test_onnx_target_and_fp16_and_the_refusals
    (llava) share one checkpoint and export, whichever runs first (pytest does not group the two)."""
    cache: dict[str, Exported] = {}

    def get(family: str) -> Exported:
        if family not in cache:
            cache[family] = Exported(family, tmp_path_factory.mktemp("vlm"))
        return cache[family]

    return get


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, made) -> Exported:
    return made(request.param)


def test_vision_graph_matches_hf_image_features(exported):
    from kvforge.models.vision_families import VISION_FAMILIES
    from kvforge.runtime.backends.vision_encoder import VisionEncoder

    encoder = VisionEncoder(exported.out, exported.manifest)
    for seed, (height, width) in enumerate(((70, 90), (120, 60), (56, 56))):
        pixels = exported.pixels(_image(seed, height, width))
        with torch.no_grad():
            want = VISION_FAMILIES[exported.family].features(exported.model, pixels).numpy()
        got = encoder.encode(pixels[0].numpy())
        assert got.shape == want.shape == (exported.vision["tokens_per_image"], exported.vision["hidden_size"])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_prefill_with_an_image_matches_hf_logits_at_every_step_and_greedy_tokens(exported):
    image = _image(3, 80, 100)
    result = exported.gen.generate("Describe <image> in a few words", images=[image], max_new_tokens=NEW_TOKENS,
                                   greedy=True, ignore_eos=True, keep_logits=True)
    ids = exported.hf_ids("Describe ", " in a few words")
    pixels = exported.pixels(image)
    assert result.tokens[0] == exported.hf_greedy(ids, pixels)
    with torch.no_grad():  # HF's logits over the prompt and the generated tokens, teacher-forced
        full = exported.model(input_ids=torch.tensor([ids + result.tokens[0]]), pixel_values=pixels).logits[0].numpy()
    steps = np.stack([np.asarray(step)[0] for step in result.logits])
    want = full[len(ids) - 1: len(ids) - 1 + len(steps)]
    np.testing.assert_allclose(steps, want, atol=1e-3, rtol=0)


def test_a_batch_of_two_prompts_with_different_images_gives_each_its_own_tokens(exported):
    images = [_image(5, 64, 128), _image(6, 140, 70)]
    prompts = ["<image> What is this?", "Look at it: <image> and tell me what the picture shows, please"]
    batch = exported.gen.generate(prompts, images=[[images[0]], [images[1]]], max_new_tokens=16, greedy=True,
                                  ignore_eos=True)
    for i, prompt in enumerate(prompts):
        alone = exported.gen.generate(prompt, images=[images[i]], max_new_tokens=16, greedy=True, ignore_eos=True)
        assert batch.tokens[i] == alone.tokens[0]
        before, after = prompt.split("<image>")
        assert batch.tokens[i] == exported.hf_greedy(exported.hf_ids(before, after), exported.pixels(images[i]), 16)
    assert batch.tokens[0] != batch.tokens[1]


def test_text_only_requests_to_a_vision_export_are_the_text_model(exported):
    ids = exported.tokenizer("Once upon a time")["input_ids"]
    result = exported.gen.generate("Once upon a time", max_new_tokens=16, greedy=True, ignore_eos=True)
    assert result.tokens[0] == exported.hf_greedy(ids, None, 16)
    from kvforge.core.errors import InputError
    from kvforge.exporter.export import export_model
    from kvforge.runtime import Generator

    out = exported.out.parent / f"{exported.family}.text"  # the same checkpoint exported --text-only: the same tokens
    manifest = export_model(exported.hf_dir, out, text_only=True)
    assert "vision" not in manifest and "vision" not in manifest["graphs"]
    text = Generator(out)
    assert text.generate("Once upon a time", max_new_tokens=16, greedy=True, ignore_eos=True).tokens == result.tokens
    with pytest.raises(InputError, match="takes no images"):
        text.generate("Describe <image>", images=[_image(1, 30, 30)], max_new_tokens=2)


def test_onnx_target_and_fp16_and_the_refusals(made, tmp_path):
    import json
    import shutil

    from kvforge.core.errors import ManifestError, UnsupportedModelError
    from kvforge.exporter.export import export_model
    from kvforge.runtime import Generator

    # The module's llava checkpoint and its ort fp32 export (the defaults), copied: this test edits both.
    exported = made("llava")
    shutil.copytree(exported.hf_dir, tmp_path / "hf")
    shutil.copytree(exported.out, tmp_path / "ort-fp32")
    image = _image(9, 70, 90)
    tokens = {}
    for target, dtype in (("ort", "fp32"), ("onnx", "fp32"), ("onnx", "fp16"), ("ort", "fp16")):
        if (target, dtype) == ("ort", "fp32"):
            manifest = exported.manifest
        else:
            manifest = export_model(tmp_path / "hf", tmp_path / f"{target}-{dtype}", target=target, dtype=dtype)
        assert manifest["graphs"]["vision"]["inputs"][0]["dtype"] == {"fp32": "float32", "fp16": "float16"}[dtype]
        result = Generator(tmp_path / f"{target}-{dtype}").generate("Describe <image>", images=[image],
                                                                    max_new_tokens=12, greedy=True, ignore_eos=True)
        tokens[target, dtype] = result.tokens[0]
    assert tokens["onnx", "fp32"] == tokens["ort", "fp32"]
    # int4 weights quantise the text graphs; vision.onnx stays in the activations' dtype (its accuracy is not
    # measured yet: a tiny random model's int4 tokens say little)
    manifest = export_model(tmp_path / "hf", tmp_path / "int4", quantize="int4", quant_method="rtn")
    assert manifest["graphs"]["vision"]["op_counts"].get("com.microsoft.MatMulNBits") is None
    assert manifest["graphs"]["prefill"]["op_counts"].get("com.microsoft.MatMulNBits")
    assert len(Generator(tmp_path / "int4").generate("Describe <image>", images=[image], max_new_tokens=4,
                                                      greedy=True, ignore_eos=True).tokens[0]) == 4
    # fp16 rounding may move a near-tie late in a random model's answer; the first tokens agree
    assert tokens["onnx", "fp16"][:4] == tokens["ort", "fp16"][:4] == tokens["ort", "fp32"][:4]
    with pytest.raises(UnsupportedModelError, match="--target trt takes no images yet"):
        export_model(tmp_path / "hf", tmp_path / "trt", target="trt")
    assert not (tmp_path / "trt").exists()
    record = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps({**record, "image_processor_type":
                                                                           "GotOcr2ImageProcessor",
                                                                           "crop_to_patches": True}))
    with pytest.raises(UnsupportedModelError, match="crop_to_patches"):
        export_model(tmp_path / "hf", tmp_path / "tiled")
    # A manifest whose vision record was tampered with is refused on load, naming the field.
    folder = tmp_path / "ort-fp32"
    manifest = json.loads((folder / "kvforge.json").read_text())
    manifest["vision"]["tokens_per_image"] = 0
    (folder / "kvforge.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="vision.tokens_per_image"):
        Generator(folder)


def test_bad_image_requests_are_refused(exported):
    from kvforge.core.errors import InputError

    with pytest.raises(InputError, match="image place"):
        exported.gen.generate("two <image> places <image>", images=[_image(1, 30, 30)], max_new_tokens=2)
    with pytest.raises(InputError, match="a list per prompt"):
        exported.gen.generate(["a", "b"], images=[_image(1, 30, 30)], max_new_tokens=2)
    with pytest.raises(InputError, match="too many images"):
        exported.gen.generate("many", images=[_image(1, 30, 30)] * 9, max_new_tokens=2)
    with pytest.raises(InputError, match="inline images only"):
        exported.gen.generate("remote <image>", images=["http://example.com/a.png"], max_new_tokens=2)


def scheduled_turn(scheduler, gen, prompt: str, image) -> tuple[list[int], object]:
    """One greedy 8-token request with `image` through a running Scheduler: its tokens and its Done event."""
    import queue

    from kvforge.runtime.drivers.handles import Done

    events: queue.Queue = queue.Queue()
    scheduler.submit(gen.request(prompt, 8, greedy=True, ignore_eos=True, images=[image]), on_event=events.put)
    tokens = []
    while not isinstance(event := events.get(timeout=60), Done):
        tokens.extend(event.token_ids)
    return tokens, event


def test_a_second_turn_about_the_same_image_reuses_the_cache(exported):
    """Through the Scheduler (what serving runs): the second turn's prefix, the image's tokens included, comes
    from the prefix store, and its answer equals the Generator's for the whole conversation."""

    from kvforge.runtime.drivers.handles import Done
    from kvforge.runtime.drivers.scheduler import Scheduler

    image = _image(21, 90, 70)
    scheduler = Scheduler(exported.gen.export, max_batch=2, max_seq_len=256, prefill_chunk=8).start()
    try:
        def turn(prompt: str) -> tuple[list[int], Done]:
            return scheduled_turn(scheduler, exported.gen, prompt, image)

        first, done = turn("Look: <image> What is it?")
        assert done.cached_tokens == 0
        answer = exported.tokenizer.decode(first)
        second, done = turn(f"Look: <image> What is it?{answer} And the colours?")
        assert done.cached_tokens >= exported.vision["tokens_per_image"]
        alone = exported.gen.generate(f"Look: <image> What is it?{answer} And the colours?", images=[image],
                                      max_new_tokens=8, greedy=True, ignore_eos=True)
        assert second == alone.tokens[0]
    finally:
        scheduler.close()


def test_kvforge_parity_passes_on_the_vision_export(exported):
    """`kvforge parity` checks a vision export's text path against the checkpoint's text model, which computes
    what the whole model does (Aya Vision: without Cohere 2's logit_scale, as its whole model)."""
    from kvforge.tools.parity import run_parity

    report = run_parity(exported.hf_dir, exported.out, new_tokens=8, perplexity_tokens=0)
    assert report.passed, report.summary()
    ids = exported.tokenizer("Once upon a time")["input_ids"]
    with torch.no_grad():
        whole = exported.model(input_ids=torch.tensor([ids])).logits[0, -1].numpy()
    got = exported.gen.generate("Once upon a time", max_new_tokens=1, greedy=True, keep_logits=True).logits[0][0]
    np.testing.assert_allclose(got, whole, atol=1e-3, rtol=0)  # the whole model's logits, text only


def test_two_images_in_one_prompt_match_hf(exported):
    images = [_image(41, 60, 80), _image(42, 100, 50)]
    result = exported.gen.generate("First <image> then <image> compare", images=images, max_new_tokens=12,
                                   greedy=True, ignore_eos=True)
    run = [*exported.vision["before_ids"], *[exported.vision["image_token_id"]] * exported.vision["tokens_per_image"],
           *exported.vision["after_ids"]]
    ids = exported.tokenizer("First ")["input_ids"] + run
    ids += exported.tokenizer(" then ", add_special_tokens=False)["input_ids"] + run
    ids += exported.tokenizer(" compare", add_special_tokens=False)["input_ids"]
    assert result.prompt_tokens[0] == len(ids)
    assert result.tokens[0] == exported.hf_greedy(ids, exported.pixels(*images), 12)

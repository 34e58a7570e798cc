"""InternVL and Aya Vision exported whole with their images tiled as released (kvforge/tools/vlm_fixtures.py
TINY_VLMS: up to 4 tiles and a thumbnail): vision.onnx over an image's tiles against Hugging Face's image features;
one and two images of different sizes (so different tile counts) against HF `generate` on the Processor's own ids,
logits at every step; a batch of two prompts; a second turn from the prefix store; `kvforge parity`; text-only."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_vision_language import scheduled_turn  # noqa: E402
from vlm_testing import load_tiny_vlm, no_videos, rgb_image, tiny_vlm_export  # noqa: E402

from kvforge.tools.vlm_fixtures import TINY_VLMS  # noqa: E402

FAMILIES = ("internvl", "aya_vision")
NEW_TOKENS = 32
pytestmark = pytest.mark.xdist_group("tiled-vision")  # each family's export made once, on one worker
# Where each family's prompts mark an image (its Processor's placeholder; kvforge's prompt placeholder is "<image>").
HF_PLACEHOLDER = {"internvl": "<IMG_CONTEXT>", "aya_vision": "<image>"}


class Tiled:
    """A family's tiny checkpoint, its fp32 `ort` export, HF's model and Processor, and a Generator."""

    def __init__(self, family: str, shared) -> None:
        import json

        from transformers import AutoImageProcessor, AutoTokenizer

        from kvforge.runtime import Generator

        self.family, self.hf_dir, self.out = family, shared / "hf", shared / "export"
        self.model = load_tiny_vlm(self.hf_dir)
        self.manifest = json.loads((self.out / "kvforge.json").read_text())
        self.vision = self.manifest["vision"]
        settings = TINY_VLMS[family].get("settings", {})
        image_processor = AutoImageProcessor.from_pretrained(self.hf_dir, backend="pil")
        if family == "internvl":
            names = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                     "video_token": "<unused0>"}  # a video token the Processor reads (videos are not tested here)
            self.tokenizer = AutoTokenizer.from_pretrained(self.hf_dir, extra_special_tokens=names)
            self.processor = no_videos(transformers.InternVLProcessor)(
                image_processor=image_processor, tokenizer=self.tokenizer, **settings)
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
            self.processor = transformers.AyaVisionProcessor(image_processor=image_processor,
                                                             tokenizer=self.tokenizer, **settings)
        self.gen = Generator(self.out)

    def hf_inputs(self, prompt: str, images: list) -> dict:
        text = prompt.replace("<image>", HF_PLACEHOLDER[self.family])
        return dict(self.processor(text=[text], images=images or None, return_tensors="pt"))

    def hf_greedy(self, inputs: dict, new: int) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def tiled(request, tmp_path_factory) -> Tiled:
    return Tiled(request.param, tiny_vlm_export(tmp_path_factory, request.param))


def test_vision_graph_matches_hf_image_features_over_each_images_tiles(tiled):
    from kvforge.models.vision_families import VISION_FAMILIES
    from kvforge.runtime.backends.vision_encoder import TileEncoder
    from kvforge.runtime.media.tiling import tile_image

    encoder = TileEncoder(tiled.out, tiled.manifest)
    counts = set()
    for seed, (height, width) in enumerate(((70, 90), (150, 60), (56, 170))):
        image = rgb_image(seed, height, width)
        pixels = tiled.hf_inputs("<image>", [image])["pixel_values"]
        ours = tile_image(image, tiled.vision)
        np.testing.assert_array_equal(np.stack(ours.tiles), pixels.numpy())  # the processor's tiles, exactly
        with torch.no_grad():
            want = VISION_FAMILIES[tiled.family].features(tiled.model, pixels).numpy()
        got, _ = encoder.encode(np.stack(ours.tiles))
        assert got.shape == want.shape == (len(ours.tiles) * tiled.vision["tokens_per_tile"],
                                           tiled.vision["hidden_size"])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        counts.add(len(ours.tiles))
    assert len(counts) >= 2  # the sizes give different tile grids


@pytest.mark.parametrize("images", [1, 2])
def test_images_match_hf_generate_and_logits_at_every_step(tiled, images):
    pictures = [rgb_image(10 + i, 80 + 60 * i, 100 - 30 * i) for i in range(images)]
    prompt = "Describe <image> in a few words" + (" and compare it with <image>" if images == 2 else "")
    inputs = tiled.hf_inputs(prompt, pictures)
    ids = inputs["input_ids"][0].tolist()
    result = tiled.gen.generate(prompt, images=pictures, max_new_tokens=NEW_TOKENS, greedy=True, ignore_eos=True,
                                keep_logits=True)
    assert result.prompt_tokens[0] == len(ids)  # the Processor's ids: the tiles' runs written as it writes them
    assert result.tokens[0] == tiled.hf_greedy(inputs, NEW_TOKENS)
    with torch.no_grad():  # teacher-forced over the prompt and the tokens generated
        full = tiled.model(input_ids=torch.tensor([ids + result.tokens[0]]),
                           pixel_values=inputs["pixel_values"]).logits[0]
    steps = np.stack([np.asarray(step)[0] for step in result.logits])
    np.testing.assert_allclose(steps, full[len(ids) - 1:len(ids) - 1 + len(steps)].numpy(), atol=1e-3, rtol=0)


def test_the_runtime_writes_the_processors_ids(tiled):
    """The expanded prompt, id for id, is the Processor's (tile markers, thumbnails and all)."""
    pictures = [rgb_image(3, 150, 60), rgb_image(4, 56, 56)]
    prompt = "A <image> and B <image> ?"
    want = tiled.hf_inputs(prompt, pictures)["input_ids"][0].tolist()
    export = tiled.gen.export
    rows, _, row_images = export.prompt_inputs(tiled.gen.request(prompt, 1, images=pictures))
    assert rows[0] == want
    assert sum(row_images[0].counts) == rows[0].count(tiled.vision["image_token_id"])


def test_a_batch_of_two_prompts_with_different_images_equals_each_alone(tiled):
    pictures = [rgb_image(5, 64, 128), rgb_image(6, 140, 70)]
    prompts = ["<image> What is this?", "Look at it: <image> and say what it shows, please"]
    batch = tiled.gen.generate(prompts, images=[[pictures[0]], [pictures[1]]], max_new_tokens=16, greedy=True,
                               ignore_eos=True)
    for i, prompt in enumerate(prompts):
        alone = tiled.gen.generate(prompt, images=[pictures[i]], max_new_tokens=16, greedy=True, ignore_eos=True)
        assert batch.tokens[i] == alone.tokens[0] == tiled.hf_greedy(tiled.hf_inputs(prompt, [pictures[i]]), 16)
    assert batch.tokens[0] != batch.tokens[1]


def test_a_second_turn_about_the_same_image_reuses_the_cache(tiled):
    from kvforge.runtime.drivers.scheduler import Scheduler

    image = rgb_image(21, 90, 170)
    scheduler = Scheduler(tiled.gen.export, max_batch=2, max_seq_len=512, prefill_chunk=16).start()
    try:
        first, done = scheduled_turn(scheduler, tiled.gen, "Look: <image> What is it?", image)
        assert done.cached_tokens == 0
        prompt = f"Look: <image> What is it?{tiled.tokenizer.decode(first)} And the colours?"
        second, done = scheduled_turn(scheduler, tiled.gen, prompt, image)
        assert done.cached_tokens > 2 * tiled.vision["tokens_per_tile"]  # the tiles' tokens came from the store
        alone = tiled.gen.generate(prompt, images=[image], max_new_tokens=8, greedy=True, ignore_eos=True)
        assert second == alone.tokens[0]
    finally:
        scheduler.close()


def test_parity_and_text_only_requests(tiled):
    from kvforge.tools.parity import run_parity

    report = run_parity(tiled.hf_dir, tiled.out, new_tokens=8, perplexity_tokens=0)
    assert report.passed, report.summary()
    inputs = dict(tiled.tokenizer(["Once upon a time"], return_tensors="pt"))
    result = tiled.gen.generate("Once upon a time", max_new_tokens=16, greedy=True, ignore_eos=True)
    assert result.tokens[0] == tiled.hf_greedy(inputs, 16)

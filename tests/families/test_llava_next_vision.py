"""LLaVA-NeXT and LLaVA-OneVision exported whole, their images tiled "anyres" (kvforge/tools/vlm_fixtures.py
TINY_VLMS: 56-pixel tiles, grids of 1x2 to 3x3 tiles after the base tile): vision.onnx over an image's tiles, packed by
the runtime (runtime/media/llava_next_pack.py), against Hugging Face's get_image_features; one and two images of
different sizes (different token counts) against HF `generate` on the Processor's own ids, logits at every step; a
batch of two prompts; a second turn from the prefix store; `kvforge parity`; text-only."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_vision_language import scheduled_turn  # noqa: E402
from vlm_testing import rgb_image  # noqa: E402

from kvforge.tools.vlm_fixtures import build_tiny_vlm  # noqa: E402

FAMILIES = ("llava_next", "llava_onevision")
NEW_TOKENS = 32
pytestmark = pytest.mark.xdist_group("llava-next-vision")  # each family's export made once, on one worker



def _no_videos(cls: type) -> type:
    """`cls` taking no video processor (transformers' video processors need torchvision, not installed here)."""
    class NoVideos(cls):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    return NoVideos


class Anyres:
    """A family's tiny checkpoint, its fp32 `ort` export, HF's model and Processor, and a Generator."""

    def __init__(self, family: str, root) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        from kvforge.exporter.export import export_model
        from kvforge.runtime import Generator

        self.family, self.hf_dir, self.out = family, root / family, root / f"{family}.export"
        self.model = build_tiny_vlm(family, self.hf_dir)
        self.manifest = export_model(self.hf_dir, self.out, target="ort")
        self.vision = self.manifest["vision"]
        settings = json.loads((self.hf_dir / "processor_config.json").read_text())
        image_processor = AutoImageProcessor.from_pretrained(self.hf_dir, backend="pil")
        self.tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        cls = transformers.LlavaNextProcessor if family == "llava_next" else \
            _no_videos(transformers.LlavaOnevisionProcessor)
        self.processor = cls(image_processor=image_processor, tokenizer=self.tokenizer, **settings)
        self.gen = Generator(self.out)

    def hf_inputs(self, prompt: str, images: list) -> dict:
        return dict(self.processor(text=[prompt], images=[images] if images else None, return_tensors="pt"))

    def hf_greedy(self, inputs: dict, new: int) -> list[int]:
        """HF's greedy tokens, going on past an end-of-sequence token as ignore_eos does (min_new_tokens would
        mask the token's logit instead)."""
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.shape[1] == inputs["input_ids"].shape[1] + new
        return out[0, inputs["input_ids"].shape[1]:].tolist()


def _turn(scheduler, gen, prompt: str, images: list) -> tuple[list[int], Any]:
    """One greedy 8-token request with `images` through a running Scheduler: its tokens and its Done event."""
    import queue

    from kvforge.runtime.drivers.handles import Done

    events: queue.Queue = queue.Queue()
    scheduler.submit(gen.request(prompt, 8, greedy=True, ignore_eos=True, images=images), on_event=events.put)
    tokens = []
    while not isinstance(event := events.get(timeout=60), Done):
        tokens.extend(event.token_ids)
    return tokens, event


@pytest.fixture(scope="module", params=FAMILIES)
def anyres(request, tmp_path_factory) -> Anyres:
    return Anyres(request.param, tmp_path_factory.mktemp("anyres"))


def test_vision_graph_and_pack_match_hf_image_features(anyres):
    """Per tile, the graph's rows are HF's tower and projector; packed, HF's get_image_features of the image."""
    from kvforge.models.vision_families import VISION_FAMILIES
    from kvforge.runtime.backends.vision_encoder import TileEncoder
    from kvforge.runtime.media.tiling import pack_features, tile_image

    encoder = TileEncoder(anyres.out, anyres.manifest)
    counts, grids = set(), set()
    for seed, (height, width) in enumerate(((70, 90), (150, 60), (56, 170), (200, 190))):
        image = rgb_image(seed, height, width)
        inputs = anyres.hf_inputs("<image>", [image])
        ours = tile_image(image, anyres.vision)
        np.testing.assert_array_equal(np.stack(ours.tiles), inputs["pixel_values"][0].numpy())  # the tiles, exactly
        got, extras = encoder.encode(np.stack(ours.tiles))
        with torch.no_grad():
            want, newline = VISION_FAMILIES[anyres.family].features(anyres.model, inputs["pixel_values"][0])
            packed = anyres.model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                            image_sizes=inputs["image_sizes"]).pooler_output[0]
        assert got.shape == want.shape == (len(ours.tiles) * anyres.vision["tokens_per_tile"],
                                           anyres.vision["hidden_size"])
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=0)
        np.testing.assert_array_equal(extras[0], newline.detach().numpy())
        rows = pack_features(got, extras, ours, anyres.vision)
        assert rows.shape[0] == ours.image_tokens == int((inputs["input_ids"] == anyres.vision["image_token_id"]).sum())
        np.testing.assert_allclose(rows, packed.numpy(), atol=1e-4, rtol=0)
        counts.add(ours.image_tokens)
        grids.add((ours.rows, ours.cols))
    assert len(counts) == 4 and len(grids) >= 3  # the sizes give different grids and token counts


@pytest.mark.parametrize("images", [1, 2])
def test_images_match_hf_generate_and_logits_at_every_step(anyres, images):
    pictures = [rgb_image(10 + i, 80 + 70 * i, 100 - 40 * i) for i in range(images)]
    prompt = "Describe <image> in a few words" + (" and compare it with <image>" if images == 2 else "")
    inputs = anyres.hf_inputs(prompt, pictures)
    ids = inputs["input_ids"][0].tolist()
    result = anyres.gen.generate(prompt, images=pictures, max_new_tokens=NEW_TOKENS, greedy=True, ignore_eos=True,
                                 keep_logits=True)
    assert result.prompt_tokens[0] == len(ids)  # the Processor's ids: each image's own token count
    assert result.tokens[0] == anyres.hf_greedy(inputs, NEW_TOKENS)
    with torch.no_grad():  # teacher-forced over the prompt and the tokens generated
        extra = {"batch_num_images": inputs["batch_num_images"]} if "batch_num_images" in inputs else {}
        full = anyres.model(input_ids=torch.tensor([ids + result.tokens[0]]), pixel_values=inputs["pixel_values"],
                            image_sizes=inputs["image_sizes"], **extra).logits[0]
    steps = np.stack([np.asarray(step)[0] for step in result.logits])
    np.testing.assert_allclose(steps, full[len(ids) - 1:len(ids) - 1 + len(steps)].numpy(), atol=1e-3, rtol=0)


def test_the_runtime_writes_the_processors_ids(anyres):
    """The expanded prompt, id for id, is the Processor's; two images of different sizes take different counts."""
    pictures = [rgb_image(3, 150, 60), rgb_image(4, 60, 70)]
    prompt = "A <image> and B <image> ?"
    want = anyres.hf_inputs(prompt, pictures)["input_ids"][0].tolist()
    export = anyres.gen.export
    rows, _, row_images = export.prompt_inputs(anyres.gen.request(prompt, 1, images=pictures))
    assert rows[0] == want
    assert sum(row_images[0].counts) == rows[0].count(anyres.vision["image_token_id"])
    if anyres.family == "llava_next":  # OneVision's images of a prompt with several are one tile each
        assert row_images[0].counts[0] != row_images[0].counts[1]


def test_a_batch_of_two_prompts_with_different_images_equals_each_alone(anyres):
    pictures = [rgb_image(5, 64, 128), rgb_image(6, 140, 70)]
    prompts = ["<image> What is this?", "Look at it: <image> and say what it shows, please"]
    batch = anyres.gen.generate(prompts, images=[[pictures[0]], [pictures[1]]], max_new_tokens=16, greedy=True,
                                ignore_eos=True)
    for i, prompt in enumerate(prompts):
        alone = anyres.gen.generate(prompt, images=[pictures[i]], max_new_tokens=16, greedy=True, ignore_eos=True)
        assert batch.tokens[i] == alone.tokens[0] == anyres.hf_greedy(anyres.hf_inputs(prompt, [pictures[i]]), 16)
    assert batch.tokens[0] != batch.tokens[1]


def test_a_second_turn_about_the_same_image_reuses_the_cache(anyres):
    from kvforge.runtime.drivers.scheduler import Scheduler

    image = rgb_image(21, 90, 170)
    scheduler = Scheduler(anyres.gen.export, max_batch=2, max_seq_len=512, prefill_chunk=16).start()
    try:
        first, done = scheduled_turn(scheduler, anyres.gen, "Look: <image> What is it?", image)
        assert done.cached_tokens == 0
        prompt = f"Look: <image> What is it?{anyres.tokenizer.decode(first)} And the colours?"
        second, done = scheduled_turn(scheduler, anyres.gen, prompt, image)
        assert done.cached_tokens > 2 * anyres.vision["tokens_per_tile"]  # the tiles' tokens came from the store
        alone = anyres.gen.generate(prompt, images=[image], max_new_tokens=8, greedy=True, ignore_eos=True)
        assert second == alone.tokens[0]
    finally:
        scheduler.close()


def test_an_image_among_several_is_not_its_prefix_alone(anyres):
    """OneVision: an image alone (tiled) and the same image in a prompt with two (one tile) are different features,
    so a turn with both after one with it alone takes no image token from the store, and equals HF."""
    if anyres.family != "llava_onevision":
        pytest.skip("LLaVA-NeXT tiles an image the same way whatever the prompt holds")
    from kvforge.runtime.drivers.scheduler import Scheduler

    pictures = [rgb_image(31, 150, 90), rgb_image(32, 70, 60)]
    scheduler = Scheduler(anyres.gen.export, max_batch=2, max_seq_len=512, prefill_chunk=16).start()
    try:
        _, done = _turn(scheduler, anyres.gen, "Look: <image> What is it?", pictures[:1])
        assert done.cached_tokens == 0
        prompt = "Look: <image> What is it? And <image>?"
        tokens, done = _turn(scheduler, anyres.gen, prompt, pictures)
        inputs = anyres.hf_inputs(prompt, pictures)
        before = inputs["input_ids"][0].tolist().index(anyres.vision["image_token_id"])
        assert done.cached_tokens <= before  # the text before the image at most
        assert tokens == anyres.hf_greedy(inputs, 8)
    finally:
        scheduler.close()


def test_parity_and_text_only_requests(anyres):
    from kvforge.tools.parity import run_parity

    report = run_parity(anyres.hf_dir, anyres.out, new_tokens=8, perplexity_tokens=0)
    assert report.passed, report.summary()
    inputs = dict(anyres.tokenizer(["Once upon a time"], return_tensors="pt"))
    result = anyres.gen.generate("Once upon a time", max_new_tokens=16, greedy=True, ignore_eos=True)
    assert result.tokens[0] == anyres.hf_greedy(inputs, 16)


def test_refusals(anyres, tmp_path):
    """A processor_config.json whose strategy is not the model's is refused at export; a crafted pack is refused at
    load."""
    import shutil

    from kvforge.core.errors import ManifestError, UnsupportedModelError
    from kvforge.models.families.llava_next import prompt_record
    from kvforge.runtime import Generator

    folder = tmp_path / "hf"
    shutil.copytree(anyres.hf_dir, folder)
    settings = json.loads((folder / "processor_config.json").read_text())
    strategy = {"default": "full", "full": "default"}[settings["vision_feature_select_strategy"]]
    (folder / "processor_config.json").write_text(json.dumps({**settings, "vision_feature_select_strategy": strategy}))
    with pytest.raises(UnsupportedModelError, match="vision_feature_select_strategy"):
        prompt_record(folder, anyres.model.config)
    if anyres.family == "llava_onevision":  # a pooling budget other than the model's
        (folder / "processor_config.json").write_text(json.dumps({**settings, "vision_aspect_ratio": "anyres_max_9"}))
        with pytest.raises(UnsupportedModelError, match="vision_aspect_ratio 'anyres_max_9' is not the model's"):
            prompt_record(folder, anyres.model.config)
    tampered = tmp_path / "tampered"
    shutil.copytree(anyres.out, tampered)
    manifest = json.loads((tampered / "kvforge.json").read_text())
    manifest["vision"]["pack"] = "nope"
    (tampered / "kvforge.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="pack"):
        Generator(tampered)

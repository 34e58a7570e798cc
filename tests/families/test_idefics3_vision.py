"""Idefics3 and SmolVLM exported whole (kvforge/tools/vlm_fixtures.py TINY_VLMS["idefics3"], ["smolvlm"]): an image
split into tiles plus the global one (runtime/media/tiles_idefics3.py), vision.onnx over an image's tiles as one batch
against Hugging Face's get_image_features, one and two images of different tile counts against HF `generate` with the
Processor's prompt (logits at every step), a batch, a second turn from the prefix store, `kvforge parity` and
text-only requests."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_vision_language import scheduled_turn  # noqa: E402
from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE  # noqa: E402
from vlm_testing import rgb_image  # noqa: E402

from kvforge.tools.vlm_fixtures import IMAGE_TOKEN_ID, build_tiny_vlm  # noqa: E402

NEW_TOKENS = 32
TOLERANCE = 1e-4  # vision features, fp32
LOGITS = 1e-3
# (family, targets): Idefics3 on both targets, SmolVLM (the same code, another pixel shuffle) on ort.
CASES = {"idefics3": ("ort", "onnx"), "smolvlm": ("ort",)}
# (height, width) -> the tile grid at the fixture's sizes (longest edge 128, 64-pixel tiles): wide 1x2, tall 2x1,
# square-ish 2x2; plus the global tile: 3, 3 and 5 tiles.
SIZES = {(60, 150): (1, 2), (170, 70): (2, 1), (140, 120): (2, 2)}
pytestmark = pytest.mark.xdist_group("idefics3-vision")  # its exports made once, on one worker



def _processor(family: str, folder) -> object:
    """The family's Processor as released (image_seq_len from processor_config.json), its PIL image processor (the
    runtime's port is of that backend) and the checkpoint's tokenizer; SmolVLM's without a video processor (they need
    torchvision) and with num2words (for video prompts only) stubbed while it is made."""
    import json

    from transformers import AutoTokenizer
    from transformers.models.smolvlm import processing_smolvlm

    name = "Idefics3" if family == "idefics3" else "SmolVLM"
    image_processor = getattr(transformers, f"{name}ImageProcessorPil").from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    seq = json.loads((folder / "processor_config.json").read_text())["image_seq_len"]
    if family == "idefics3":
        return transformers.Idefics3Processor(image_processor, tokenizer, image_seq_len=seq)

    class NoVideos(transformers.SmolVLMProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: object) -> object:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(processing_smolvlm, "num2words", processing_smolvlm.num2words or str)
        return NoVideos(image_processor=image_processor, video_processor=None, tokenizer=tokenizer, image_seq_len=seq)


class Tiled:
    """A family's tiny checkpoint, its fp32 exports per target, HF's model and Processor, a Generator per target."""

    def __init__(self, family: str, root) -> None:
        from kvforge.exporter.export import export_model
        from kvforge.runtime import Generator

        self.family, self.hf_dir = family, root / family
        self.model = build_tiny_vlm(family, self.hf_dir)
        # SmolVLM's released chat template (Idefics3-8B's is the same with "<|begin_of_text|>" first): an image part
        # is "<image>", which the Processor expands.
        (self.hf_dir / "chat_template.jinja").write_text(DEFAULT_CHAT_TEMPLATE)
        self.manifests = {t: export_model(self.hf_dir, root / t, target=t) for t in CASES[family]}
        self.folders = {t: root / t for t in CASES[family]}
        self.gens = {t: Generator(root / t) for t in CASES[family]}
        self.vision = self.manifests["ort"]["vision"]
        self.processor = _processor(family, self.hf_dir)
        self.tokenizer = self.processor.tokenizer

    def hf_inputs(self, prompts: str | list[str], images: list | None) -> dict:
        prompts = [prompts] if isinstance(prompts, str) else prompts
        return dict(self.processor(text=prompts, images=images or None, return_tensors="pt", padding=True))

    def hf_greedy(self, inputs: dict, new: int) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module", params=sorted(CASES))
def tiled(request, tmp_path_factory) -> Tiled:
    return Tiled(request.param, tmp_path_factory.mktemp(request.param))


def test_vision_graph_matches_hf_image_features(tiled):
    """3 images of different sizes and aspect ratios: the runtime's tiles equal the processor's pixel_values, and
    vision.onnx over them (one batch an image) HF's get_image_features within 1e-4."""
    from kvforge.runtime.backends.vision_encoder import TileEncoder
    from kvforge.runtime.media.tiling import tile_image

    assert tiled.vision["input"] == "tiles" and tiled.vision["tiling"] == "idefics3"
    assert tiled.vision["tokens_per_tile"] == tiled.vision["prompt"]["image_seq_len"] == 16
    encoder = TileEncoder(tiled.folders["ort"], tiled.manifests["ort"])
    counts = []
    for seed, ((height, width), grid) in enumerate(SIZES.items()):
        image = rgb_image(seed, height, width)
        ours = tile_image(image, tiled.vision)
        hf = tiled.hf_inputs("<image>", [[image]])
        assert (ours.rows, ours.cols) == grid
        np.testing.assert_array_equal(np.stack(ours.tiles), hf["pixel_values"][0].numpy())
        with torch.no_grad():
            want = tiled.model.model.get_image_features(hf["pixel_values"], hf["pixel_attention_mask"]).pooler_output
        want = torch.cat(list(want)).numpy()
        got, extras = encoder.encode(np.stack(ours.tiles))
        assert got.shape == want.shape == (16 * len(ours.tiles), tiled.vision["hidden_size"]) and not extras
        error = float(np.abs(got - want).max())
        print(f"{tiled.family} {height}x{width} grid {grid}: {len(ours.tiles)} tiles, max abs err {error:.2e}")
        assert error < TOLERANCE
        counts.append(len(ours.tiles))
    assert counts == [3, 3, 5]
    # Each tile's rows are its own: a change in the second tile moves only its 16 rows.
    tiles = np.stack(tile_image(rgb_image(0, 60, 150), tiled.vision).tiles)
    changed = tiles.copy()
    changed[1, :, :8, :8] += 1.0
    delta = np.abs(encoder.encode(changed)[0] - encoder.encode(tiles)[0]).max(1)
    assert not delta[:16].any() and (delta[16:32] > 1e-3).all() and not delta[32:].any()


@pytest.mark.parametrize("images", [1, 2])
def test_images_match_hf_generate_and_logits_at_every_step(tiled, images):
    """One image, and two of different tile counts (3 and 5): the runtime's prompt is the Processor's, id for id
    (the tile tags and the global image's tokens), its 32 greedy tokens are HF's and its logits HF's within 1e-3."""
    pictures = [rgb_image(10, 60, 150), rgb_image(11, 140, 120)][:images]
    prompt = "Describe <image> in a few words" + (" and compare it with <image>" if images == 2 else "")
    inputs = tiled.hf_inputs(prompt, [pictures])
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(IMAGE_TOKEN_ID) == 16 * (3 + 5 * (images == 2))
    want = tiled.hf_greedy(inputs, NEW_TOKENS)
    with torch.no_grad():  # teacher-forced over HF's greedy answer
        full = tiled.model(input_ids=torch.tensor([ids + want]), pixel_values=inputs["pixel_values"],
                           pixel_attention_mask=inputs["pixel_attention_mask"]).logits[0]
        # the tiles' order matters: the global tile first would move the logits far beyond the tolerance
        tiles = inputs["pixel_values"].shape[1]
        moved = tiled.model(input_ids=torch.tensor([ids + want]), pixel_attention_mask=inputs["pixel_attention_mask"],
                            pixel_values=inputs["pixel_values"][:, [tiles - 1, *range(tiles - 1)]]).logits[0]
    window = slice(len(ids) - 1, len(ids) - 1 + NEW_TOKENS)
    assert np.abs(moved[window].numpy() - full[window].numpy()).max() > 0.1
    for target, gen in tiled.gens.items():
        rows, _, _ = gen.export.prompt_inputs(gen.request(prompt, 1, images=pictures))
        assert rows == [ids], target
        result = gen.generate(prompt, images=pictures, max_new_tokens=NEW_TOKENS, greedy=True, ignore_eos=True,
                              keep_logits=True)
        assert result.tokens[0] == want, target
        steps = np.stack([np.asarray(step)[0] for step in result.logits])
        error = float(np.abs(steps - full[window].numpy()).max())
        print(f"{tiled.family} {target} {images} image(s): max abs logit err {error:.2e}")
        assert error < LOGITS, target


def test_a_chat_with_image_parts_gives_the_processors_ids(tiled):
    """The chat path: image parts in two user turns (one first in its message, one between two text parts) render as
    "<image>", which the runtime expands as the Processor's apply_chat_template does; the answer is HF's."""
    pictures = [rgb_image(31, 60, 150), rgb_image(32, 140, 120)]
    messages = [{"role": "user", "content": [{"type": "image", "image": pictures[0]},
                                             {"type": "text", "text": "What is in this picture?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "A cat on a mat."}]},
                {"role": "user", "content": [{"type": "text", "text": "And here?"},
                                             {"type": "image", "image": pictures[1]},
                                             {"type": "text", "text": "Compare them."}]}]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiled.processor, "chat_template", DEFAULT_CHAT_TEMPLATE, raising=False)
        if tiled.family == "smolvlm":  # its apply_chat_template reads the (absent) video processor's frame settings
            patch.setattr(tiled.processor, "video_processor", SimpleNamespace(num_frames=None, fps=None))
        inputs = tiled.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, return_tensors="pt")
    want = inputs["input_ids"][0].tolist()
    assert want.count(IMAGE_TOKEN_ID) == 16 * (3 + 5)
    gen = tiled.gens["ort"]
    ids, images = gen.export.chat_inputs(messages)
    rows, _, _ = gen.export.prompt_inputs(gen.request(ids, 1, images=images))
    assert rows == [want]
    answer = gen.generate(ids, images=images, max_new_tokens=8, greedy=True, ignore_eos=True).tokens[0]
    assert answer == tiled.hf_greedy(dict(inputs), 8)


def test_a_batch_of_two_prompts_with_different_images_equals_each_alone(tiled):
    gen = tiled.gens["ort"]
    pictures = [rgb_image(5, 64, 160), rgb_image(6, 150, 130)]
    prompts = ["<image> What is this?", "Look at it: <image> and say what it shows, please"]
    batch = gen.generate(prompts, images=[[pictures[0]], [pictures[1]]], max_new_tokens=16, greedy=True,
                         ignore_eos=True)
    for i, prompt in enumerate(prompts):
        alone = gen.generate(prompt, images=[pictures[i]], max_new_tokens=16, greedy=True, ignore_eos=True)
        assert batch.tokens[i] == alone.tokens[0] == tiled.hf_greedy(tiled.hf_inputs(prompt, [[pictures[i]]]), 16)
    assert batch.tokens[0] != batch.tokens[1]


def test_a_second_turn_about_the_same_image_reuses_the_prefix_store(tiled):
    """Through the Scheduler (what serving runs): the second turn's prefix, the image's tiles' tokens included, comes
    from the prefix store, and its answer equals a fresh Generator run of the whole conversation."""
    from kvforge.runtime.drivers.scheduler import Scheduler

    gen, image = tiled.gens["ort"], rgb_image(21, 140, 120)
    scheduler = Scheduler(gen.export, max_batch=2, max_seq_len=512, prefill_chunk=32).start()
    try:
        first, done = scheduled_turn(scheduler, gen, "Look: <image> What is it?", image)
        assert done.cached_tokens == 0
        prompt = f"Look: <image> What is it?{tiled.tokenizer.decode(first)} And the colours?"
        second, done = scheduled_turn(scheduler, gen, prompt, image)
        assert done.cached_tokens >= 5 * 16  # the image's five tiles' tokens
        alone = gen.generate(prompt, images=[image], max_new_tokens=8, greedy=True, ignore_eos=True)
        assert second == alone.tokens[0]
    finally:
        scheduler.close()


def test_kvforge_parity_and_text_only_requests(tiled):
    """`kvforge parity` on the export (the text model against the checkpoint's), and a text-only request on each
    target equals the whole model's greedy answer."""
    from kvforge.tools.parity import run_parity

    report = run_parity(tiled.hf_dir, tiled.folders["ort"], new_tokens=8, perplexity_tokens=0)
    assert report.passed, report.summary()
    inputs = tiled.hf_inputs("Once upon a time", None)
    want = tiled.hf_greedy({"input_ids": inputs["input_ids"]}, 16)
    for target, gen in tiled.gens.items():
        answer = gen.generate("Once upon a time", max_new_tokens=16, greedy=True, ignore_eos=True).tokens[0]
        assert answer == want, target


def test_bad_input_is_one_line(tiled):
    from kvforge.core.errors import InputError

    gen = tiled.gens["ort"]
    with pytest.raises(InputError, match=r"marks 1 image place\(s\).*2 image\(s\)"):
        gen.generate("Only <image> here", images=[rgb_image(1, 60, 150), rgb_image(2, 60, 150)], max_new_tokens=2)


def test_prompt_record_reads_the_processor_and_tokenizer(tmp_path, tiled):
    """image_seq_len from processor_config.json (refused where the model gives another count a tile); SmolVLM's
    token spellings from its tokenizer, Idefics3's fixed."""
    import json
    import shutil

    from kvforge.core.errors import UnsupportedModelError
    from kvforge.models.families.idefics3 import prompt_record

    folder = tmp_path / "copy"
    shutil.copytree(tiled.hf_dir, folder)
    config = tiled.model.config
    assert prompt_record(folder, config) == {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                                             "global_image_token": "<global-img>", "image_seq_len": 16}
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_len": 169}))
    with pytest.raises(UnsupportedModelError, match="image_seq_len is 169.*gives 16"):
        prompt_record(folder, config)
    (folder / "processor_config.json").unlink()  # absent: the model's own count
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["extra_special_tokens"] = {"image_token": "<img_x>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    record = prompt_record(folder, config)
    assert record["image_seq_len"] == 16
    assert record["image_token"] == ("<image>" if tiled.family == "idefics3" else "<img_x>")

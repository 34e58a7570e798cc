"""Qwen2-VL and Qwen2.5-VL exported whole (kvforge/tools/vlm_fixtures.py rows): images at their own size, each taking
its own number of tokens, and multimodal positions (M-RoPE: the prefill takes position_ids [3, B, S], decode the
rows' rope_deltas). Against Hugging Face's generate with the processor's pixel values and grids: 32 greedy tokens and
the logits at every step with one image and with two images of different sizes; a batch against each alone; the
decode graph's own path (separate sessions); prompt lookup; the Scheduler's second turn from the prefix store; text
requests; `kvforge parity`; and the onnx target."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_vision_language import _image, scheduled_turn  # noqa: E402
from vlm_testing import load_tiny_vlm, tiny_vlm_export  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
NEW_TOKENS = 32
pytestmark = pytest.mark.xdist_group("qwen-vl")  # each family exported once, on one worker
# Two images of different sizes and aspect ratios (grids (1, 4, 6) and (1, 10, 6) at the fixture's pixel bounds).
IMAGES = ((3, 60, 90), (4, 130, 70))


class QwenExport:
    """A family's tiny checkpoint, its fp32 export (ort), the HF model and processor, and a Generator over it."""

    def __init__(self, family: str, shared: Path) -> None:
        import json

        from transformers import AutoImageProcessor, AutoTokenizer

        from kvforge.runtime import Generator

        self.family, self.hf_dir, self.out = family, shared / "hf", shared / "export"
        self.model = load_tiny_vlm(self.hf_dir)
        self.config = self.model.config
        self.manifest = json.loads((self.out / "kvforge.json").read_text())
        self.processor = AutoImageProcessor.from_pretrained(self.hf_dir, backend="pil")
        self.tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        self.gen = Generator(self.out)

    def hf_inputs(self, pieces: list[str], images: list) -> dict:
        """What HF's processor makes of pieces[0] <image> pieces[1] <image> ...: the ids with each image's run
        (vision_start, its tokens, vision_end), the pixel values, grids and token types."""
        out = self.processor(images=images, return_tensors="pt") if images else {}
        merge = self.config.vision_config.spatial_merge_size
        ids = self.tokenizer(pieces[0])["input_ids"]
        for k, piece in enumerate(pieces[1:]):
            tokens = int(out["image_grid_thw"][k].prod()) // merge**2
            ids += [self.config.vision_start_token_id, *[self.config.image_token_id] * tokens,
                    self.config.vision_end_token_id]
            ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
        ids = torch.tensor([ids])
        extra = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]} if images else {}
        return {"input_ids": ids, "mm_token_type_ids": (ids == self.config.image_token_id).int(), **extra}

    def hf_greedy(self, inputs: dict, new: int = NEW_TOKENS) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()

    def hf_logits(self, inputs: dict, tokens: list[int]) -> np.ndarray:
        """HF's logits over the prompt and `tokens`, teacher-forced (the generated tokens at their M-RoPE positions)."""
        ids = torch.cat([inputs["input_ids"], torch.tensor([tokens])], 1)
        with torch.no_grad():
            return self.model(**{**inputs, "input_ids": ids, "mm_token_type_ids": (ids == self.config.image_token_id)
                                 .int()}).logits[0].numpy()


@pytest.fixture(scope="module", params=FAMILIES)
def qwen(request, tmp_path_factory) -> QwenExport:
    return QwenExport(request.param, tiny_vlm_export(tmp_path_factory, request.param))


def _images(*which: int) -> list:
    return [_image(*IMAGES[i]) for i in which]


def test_the_graphs_take_multimodal_positions(qwen):
    prefill = [entry["name"] for entry in qwen.manifest["graphs"]["prefill"]["inputs"]]
    decode = [entry["name"] for entry in qwen.manifest["graphs"]["decode"]["inputs"]]
    assert "position_ids" in prefill and "rope_deltas" not in prefill
    assert "rope_deltas" in decode and "position_ids" not in decode and "image_features" not in decode
    assert qwen.manifest["vision"]["positions"] == "mrope" and qwen.manifest["vision"]["tokens_per_image"] is None


@pytest.mark.parametrize("count", [1, 2])
def test_images_at_their_own_size_match_hf_at_every_step(qwen, count):
    images = _images(*range(count))
    pieces = ["Describe ", *[" and "] * (count - 1), " in a few words"]
    result = qwen.gen.generate("<image>".join(pieces), images=images, max_new_tokens=NEW_TOKENS, greedy=True,
                               ignore_eos=True, keep_logits=True)
    inputs = qwen.hf_inputs(pieces, images)
    prompt = inputs["input_ids"].shape[1]
    assert result.prompt_tokens[0] == prompt
    assert result.tokens[0] == qwen.hf_greedy(inputs)
    steps = np.stack([np.asarray(step)[0] for step in result.logits])
    np.testing.assert_allclose(steps, qwen.hf_logits(inputs, result.tokens[0])[prompt - 1: prompt - 1 + len(steps)],
                               atol=1e-3, rtol=0)


def test_a_batch_with_different_images_and_the_decode_graph_equal_each_alone(qwen):
    from kvforge.runtime import Generator

    images = _images(0, 1)
    prompts = ["<image> What is this?", "Look at it: <image> and tell me what the picture shows, please"]
    batch = qwen.gen.generate(prompts, images=[[images[0]], [images[1]]], max_new_tokens=16, greedy=True,
                              ignore_eos=True)
    separate = Generator(qwen.out, sessions="separate")  # decode.onnx: positions from past_lens + rope_deltas
    assert separate.generate(prompts, images=[[images[0]], [images[1]]], max_new_tokens=16, greedy=True,
                             ignore_eos=True).tokens == batch.tokens
    for i, prompt in enumerate(prompts):
        alone = qwen.gen.generate(prompt, images=[images[i]], max_new_tokens=16, greedy=True, ignore_eos=True)
        assert batch.tokens[i] == alone.tokens[0]
        assert batch.tokens[i] == qwen.hf_greedy(qwen.hf_inputs(prompt.split("<image>"), [images[i]]), 16)
    assert batch.tokens[0] != batch.tokens[1]


def test_prompt_lookup_with_multimodal_positions_gives_the_same_tokens(qwen):
    images = _images(1)
    prompt = "Repeat: one two three one two three <image> one two three one two"
    plain = qwen.gen.generate(prompt, images=images, max_new_tokens=24, greedy=True, ignore_eos=True)
    drafted = qwen.gen.generate(prompt, images=images, max_new_tokens=24, greedy=True, ignore_eos=True,
                                speculate="prompt-lookup", draft_len=3)
    assert drafted.tokens == plain.tokens
    assert drafted.draft_tokens > 0 and drafted.verify_steps > 0  # drafts were checked at the rows' M-RoPE positions


def test_a_second_turn_about_the_same_image_takes_its_prefix_from_the_store(qwen):
    from kvforge.runtime.drivers.scheduler import Scheduler

    image = _images(1)[0]
    scheduler = Scheduler(qwen.gen.export, max_batch=2, max_seq_len=256, prefill_chunk=8).start()
    try:
        def turn(prompt: str) -> tuple[list[int], object]:
            return scheduled_turn(scheduler, qwen.gen, prompt, image)

        first, done = turn("Look: <image> What is it?")
        assert done.cached_tokens == 0
        assert first == qwen.gen.generate("Look: <image> What is it?", images=[image], max_new_tokens=8,
                                          greedy=True, ignore_eos=True).tokens[0]
        follow = f"Look: <image> What is it?{qwen.tokenizer.decode(first)} And the colours?"
        second, done = turn(follow)
        assert done.cached_tokens > 15  # the image's 15 tokens and the text before them
        assert second == qwen.gen.generate(follow, images=[image], max_new_tokens=8, greedy=True,
                                           ignore_eos=True).tokens[0]
    finally:
        scheduler.close()


def test_text_requests_are_the_text_model_and_parity_passes(qwen):
    from kvforge.tools.parity import run_parity

    inputs = qwen.hf_inputs(["Once upon a time"], [])
    result = qwen.gen.generate("Once upon a time", max_new_tokens=16, greedy=True, ignore_eos=True)
    assert result.tokens[0] == qwen.hf_greedy(inputs, 16)
    report = run_parity(qwen.hf_dir, qwen.out, new_tokens=8, perplexity_tokens=0)
    assert report.passed, report.summary()


def test_the_onnx_target_and_the_text_only_export(qwen, tmp_path):
    from kvforge.core.errors import InputError
    from kvforge.exporter.export import export_model
    from kvforge.runtime import Generator

    if qwen.family != "qwen2_5_vl":
        pytest.skip("one family is enough for the other targets (the same graphs)")
    images = _images(0, 1)
    want = qwen.gen.generate("First <image> then <image> compare", images=images, max_new_tokens=12, greedy=True,
                             ignore_eos=True).tokens
    export_model(qwen.hf_dir, tmp_path / "onnx", target="onnx")
    assert Generator(tmp_path / "onnx").generate("First <image> then <image> compare", images=images,
                                                 max_new_tokens=12, greedy=True, ignore_eos=True).tokens == want
    manifest = export_model(qwen.hf_dir, tmp_path / "text", text_only=True)
    assert "position_ids" not in [entry["name"] for entry in manifest["graphs"]["prefill"]["inputs"]]
    text = Generator(tmp_path / "text")
    assert text.generate("Once upon a time", max_new_tokens=16, greedy=True, ignore_eos=True).tokens == \
        qwen.gen.generate("Once upon a time", max_new_tokens=16, greedy=True, ignore_eos=True).tokens
    with pytest.raises(InputError, match="image place"):
        qwen.gen.generate("two <image> places <image>", images=_images(0), max_new_tokens=2)


def test_a_four_frame_video_and_an_image_match_hf_at_every_step(qwen):
    """A video of 4 frames (kvforge.runtime.Video, sampled at 1 fps: Qwen2.5-VL's temporal positions advance 2 *
    tokens_per_second a frame pair) beside an image, against HF given the same pixel_values_videos (the numpy
    video processor equals transformers' where torchvision is installed: tests/runtime/test_qwen_vl_inputs.py)."""
    from kvforge.core.errors import InputError
    from kvforge.runtime.media.qwen_vl_preprocess import preprocess_qwen_video
    from kvforge.runtime.media.video import Video

    frames = [_image(50 + i, 70, 98) for i in range(4)]
    image = _images(0)
    prompt = "Describe <video> please, and then <image> too"
    if qwen.family == "qwen3_vl":  # timestamps between its frame groups: not taken yet (docs/vision.md)
        with pytest.raises(InputError, match="takes no videos"):
            qwen.gen.generate(prompt, images=[Video(frames), *image], max_new_tokens=2)
        return
    result = qwen.gen.generate(prompt, images=[Video(frames, fps=1.0), *image], max_new_tokens=NEW_TOKENS,
                               greedy=True, ignore_eos=True, keep_logits=True)
    pixels, grid = preprocess_qwen_video(frames, qwen.manifest["vision"]["video"])
    assert grid[0] == 2  # 4 frames: two temporal patches
    merge, config = qwen.config.vision_config.spatial_merge_size, qwen.config
    images = qwen.hf_inputs(["", ""], image)
    run = [config.vision_start_token_id, *[config.video_token_id] * (int(np.prod(grid)) // merge**2),
           config.vision_end_token_id]
    ids = qwen.tokenizer("Describe ")["input_ids"] + run
    ids += qwen.tokenizer(" please, and then ", add_special_tokens=False)["input_ids"]
    image_run = images["input_ids"][0].tolist()[len(qwen.tokenizer("")["input_ids"]):]  # without the BOS
    ids += image_run + qwen.tokenizer(" too", add_special_tokens=False)["input_ids"]
    extra = {"second_per_grid_ts": torch.tensor([2.0])} if qwen.family == "qwen2_5_vl" else {}
    inputs = {"pixel_values_videos": torch.from_numpy(pixels), "video_grid_thw": torch.tensor([grid]),
              "pixel_values": images["pixel_values"], "image_grid_thw": images["image_grid_thw"], **extra}

    def typed(ids: torch.Tensor) -> dict:
        types = (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()
        return {"input_ids": ids, "mm_token_type_ids": types, "attention_mask": torch.ones_like(ids)}

    assert result.prompt_tokens[0] == len(ids)
    with torch.no_grad():
        want = qwen.model.generate(**inputs, **typed(torch.tensor([ids])), max_new_tokens=NEW_TOKENS,
                                   min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
        full = qwen.model(**inputs, **typed(torch.tensor([ids + result.tokens[0]]))).logits[0].numpy()
    assert result.tokens[0] == want
    steps = np.stack([np.asarray(step)[0] for step in result.logits])
    np.testing.assert_allclose(steps, full[len(ids) - 1:len(ids) - 1 + len(steps)], atol=1e-3, rtol=0)


# A chat template that writes Qwen's image and video places for content parts (the tiny tokenizer has none).
VIDEO_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}{% else %}"
                  "{% for p in m.content %}{% if p.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
                  "{% elif p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}"
                  "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                  "{% endif %}")


def test_a_video_from_the_cli_and_as_a_frame_list_over_the_api(qwen, tmp_path):
    """`kvforge generate --video DIR` and a chat's video part ({"type": "video", "video": {"frames": [data URLs],
    "fps": 1}}, kvforge's: OpenAI's format has no video part) give the Python API's tokens; too many frames is one
    line naming the limit (InputError; a 400 over HTTP)."""
    import io
    import json

    from click.testing import CliRunner
    from serving import data_url, serving, with_template

    from kvforge.cli import main
    from kvforge.core.errors import InputError
    from kvforge.runtime.media.video import Video

    if qwen.family != "qwen2_5_vl":
        pytest.skip("one family is enough for the request paths (the same code)")
    frames = [_image(50 + i, 70, 98) for i in range(4)]
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, frame in enumerate(frames):
        frame.save(folder / f"{i:03d}.png")
    want = qwen.gen.generate("Describe <video> please", images=[Video(frames, fps=1.0)], max_new_tokens=8,
                             greedy=True, ignore_eos=True).tokens[0]
    out = CliRunner().invoke(main, ["generate", str(qwen.out), "--prompt", "Describe <video> please", "--video",
                                    str(folder), "--video-fps", "1", "--max-new-tokens", "8", "--greedy",
                                    "--ignore-eos", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["tokens"][0] == want, out.stdout
    with pytest.raises(InputError, match="1..32 frames"):
        qwen.gen.generate("<video>", images=[Video([frames[0]] * 33)], max_new_tokens=1)

    import openai  # noqa: E402

    from kvforge.serve.app import create_app

    def png(image) -> str:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return data_url(buffer.getvalue())

    served = with_template(qwen.out, tmp_path / "served", VIDEO_TEMPLATE)
    chat = [{"role": "user", "content": [{"type": "video", "video": {"frames": [png(f) for f in frames], "fps": 1}},
                                         {"type": "text", "text": "What happens?"}]}]
    local = qwen.gen.__class__(served).chat(chat, max_new_tokens=8, greedy=True, ignore_eos=True).text[0]
    with serving(create_app(served, max_batch=2, max_seq_len=256, model_name="qwen")) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="qwen", messages=chat, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == local
        too_many = [{"role": "user", "content": [{"type": "video", "video": {"frames": [png(frames[0])] * 33}}]}]
        with pytest.raises(openai.BadRequestError, match="1..32 frames"):
            client.chat.completions.create(model="qwen", messages=too_many, max_tokens=2)

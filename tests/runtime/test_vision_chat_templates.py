"""Chats with image parts, rendered as transformers' processor renders them (issue 53): for every vision-language
family's released chat template (tests/runtime/vision_chat_templates.py), the ids kvforge makes of a conversation with image
parts equal the processor's apply_chat_template(..., tokenize=True), built here from a tiny tokenizer and the
family's image processor (no downloads); typed placeholder text stays text; image parts are taken in messages of any
role, as transformers takes them, by Generator.chat and the server alike; an image token without images is refused;
a processor saved in transformers' current layout (processor_config.json only) exports."""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vision_chat_templates import RELEASED_TEMPLATES  # noqa: E402

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.models.vision_families import VISION_FAMILIES  # noqa: E402
from kvforge.tools.vlm_fixtures import IMAGE_TOKEN_ID, TEXT_VOCAB, TINY_VLMS  # noqa: E402

# The token each family's processor counts as an image feature, at IMAGE_TOKEN_ID in the test tokenizer.
FEATURE_TOKEN = {"llava": "<image>", "vipllava": "<image>", "video_llava": "<image>", "internvl": "<IMG_CONTEXT>",
                 "got_ocr2": "<imgpad>", "aya_vision": "<|IMG_PATCH|>", "deepseek_vl": "<image_placeholder>",
                 "janus": "<image_placeholder>"}
# The tokenizer attributes each processor reads (transformers' `extra_special_tokens`, as the released tokenizers set).
TOKENIZER_NAMES = {"internvl": {"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>",
                                "end_image_token": "</img>", "video_token": "<video>"},
                   "deepseek_vl": {"image_token": "<image_placeholder>"},
                   "janus": {"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
                             "eoi_token": "<end_of_image>"}}


def _image(seed: int, height: int = 40, width: int = 50):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8))


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    _image(seed).save(buffer, format="PNG")
    return buffer.getvalue()


def _tokenizer(family: str, folder: Path) -> Any:
    """The tiny fixtures' tokenizer (kvforge/tools/vlm_fixtures.py) with the family's tokens around an image from id
    TEXT_VOCAB on and its feature token at IMAGE_TOKEN_ID, saved to `folder`; the transformers tokenizer read back."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from kvforge.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(TEXT_VOCAB)
    tokenizer.add_special_tokens(list(TINY_VLMS[family].get("tokens", ())))
    fill = IMAGE_TOKEN_ID - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([f"<unused{i}>" for i in range(fill)] + [FEATURE_TOKEN[family]])
    assert tokenizer.token_to_id(FEATURE_TOKEN[family]) == IMAGE_TOKEN_ID
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token=None, extra_special_tokens=TOKENIZER_NAMES.get(family, {})).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def _without_videos(cls: type) -> type:
    """`cls` taking no video processor (transformers' video processors need torchvision, which is not installed)."""
    class NoVideos(cls):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    return NoVideos


def hf_processor(family: str, folder: Path, template: str) -> Any:
    """The family's transformers processor: the test tokenizer, the tiny fixture's image processor, `template`."""
    tokenizer = _tokenizer(family, folder)
    processor_class, fields = TINY_VLMS[family]["processor"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        image_processor = getattr(transformers, processor_class)(**fields)
        llava = {"patch_size": 14, "vision_feature_select_strategy": "default", "num_additional_image_tokens": 1}
        if family in ("llava", "vipllava"):
            return transformers.LlavaProcessor(image_processor, tokenizer, chat_template=template, **llava)
        if family == "video_llava":
            return _without_videos(transformers.VideoLlavaProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                    chat_template=template, **llava)
        if family == "internvl":
            return _without_videos(transformers.InternVLProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                  image_seq_length=4, chat_template=template)
        if family == "got_ocr2":
            return transformers.GotOcr2Processor(image_processor, tokenizer, chat_template=template)
        if family == "aya_vision":  # the released processor's tile token; one 2x2 patch grid per tile
            return transformers.AyaVisionProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                                                   img_size=56, downsample_factor=2, chat_template=template,
                                                   tile_global_token="<|IMG_TILE_GLOBAL|>")
        if family == "deepseek_vl":
            return transformers.DeepseekVLProcessor(image_processor, tokenizer, chat_template=template,
                                                    num_image_tokens=16)
        # As the released processor is saved: it puts its default system prompt before every text prompt.
        return transformers.JanusProcessor(image_processor, tokenizer, chat_template=template, num_image_tokens=16,
                                           use_default_system_prompt=True)


def hf_ids(processor: Any, messages: list[dict]) -> list[int]:
    """The processor's apply_chat_template(..., tokenize=True) ids (InternVL and Aya Vision tile each image)."""
    one_tile = {}
    if isinstance(processor, transformers.GotOcr2Processor):  # apply_chat_template nests a prompt's images (pages)
        one_tile = {"multi_page": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            processor_kwargs=one_tile)
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    return list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)


def kvforge_ids(family: str, folder: Path, template: str, messages: list[dict], tokens_per_image: int) -> list[int]:
    """What a vision export of the family makes of `messages` (LoadedExport.chat_inputs' steps, the runtime's own
    functions, with the vision record the exporter writes for the test tokenizer)."""
    from kvforge.exporter.vision import _processor_settings, _token_ids
    from kvforge.runtime.drivers.image_chat import image_chat_ids
    from kvforge.runtime.media.image_prompt import check_image_places, expand_images, take_image_parts
    from kvforge.runtime.text.chat import ChatTemplate
    from kvforge.runtime.text.messages import check_messages
    from kvforge.runtime.text.tokenizer import Tokenizer

    family_row = VISION_FAMILIES[family]
    vision = {"image_token_id": IMAGE_TOKEN_ID, "tokens_per_image": tokens_per_image,
              "placeholder": family_row.placeholder, "chat_placeholder": family_row.chat_placeholder,
              "before_ids": _token_ids(folder, family_row.before), "after_ids": _token_ids(folder, family_row.after),
              "prompt_prefix": family_row.prompt_prefix(_processor_settings(folder)) if family_row.prompt_prefix
              else ""}
    tokenizer = Tokenizer(folder)
    chat = ChatTemplate(template, {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    parts, images = take_image_parts(messages)
    ids = image_chat_ids(lambda ms: chat.render(ms, True), check_messages(parts, content_parts=True), tokenizer, chat,
                         vision, lambda text: tokenizer.encode(text, False))
    check_image_places(ids, images, vision, "the template")
    if family_row.tiling:  # each image's tiles and the text its Processor writes for them (runtime/media/tiling.py)
        return expand_images(ids, [0] * len(images), vision, "the conversation",
                             _tiled_runs(family, folder, images, tokenizer))
    return expand_images(ids, len(images), vision, "the conversation")


# The Processor settings hf_processor gives InternVL and Aya Vision, as their prompt records hold them.
TILED_PROMPTS = {"internvl": {"start_image_token": "<img>", "end_image_token": "</img>",
                              "context_image_token": "<IMG_CONTEXT>", "image_seq_length": 4, "crop_to_patches": True,
                              "image_token": "<IMG_CONTEXT>"},
                 "aya_vision": {"patch_size": 14, "img_size": 56, "downsample_factor": 2, "crop_to_patches": True,
                                "tile_global_token": "<|IMG_TILE_GLOBAL|>", "image_token": "<|IMG_PATCH|>"}}


def _tiled_runs(family: str, folder: Path, images: list[Any], tokenizer: Any) -> list[list[int]]:
    from kvforge.exporter.vision import processor_record
    from kvforge.runtime.media.tiling import image_run, tile_image
    from kvforge.tools.vlm_fixtures import save_tiny_processor

    save_tiny_processor(family, folder)
    vision = {"image_token_id": IMAGE_TOKEN_ID, "tiling": VISION_FAMILIES[family].tiling,
              "processor": processor_record(folder, VISION_FAMILIES[family]), "prompt": TILED_PROMPTS[family]}
    runs = []
    for image in images:
        tiled = tile_image(image, vision)
        runs.append(image_run(tiled.text, vision, tokenizer.encode, tiled.image_tokens))
    return runs


def _conversation(first: Any, second: Any = None) -> list[dict]:
    """Two user turns around an answer: an image before the text, then (`second`) one between two text parts."""
    last = [{"type": "text", "text": "And here?"}, {"type": "image", "image": second}] if second is not None else []
    return [{"role": "user", "content": [{"type": "image", "image": first},
                                         {"type": "text", "text": "What is in this picture?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A cat on a mat."}]},
            {"role": "user", "content": [*last, {"type": "text", "text": "Compare them."}]}]


@pytest.mark.parametrize("family", list(RELEASED_TEMPLATES))
def test_a_chat_with_image_parts_gives_the_processors_ids(family, tmp_path) -> None:
    template = RELEASED_TEMPLATES[family]
    processor = hf_processor(family, tmp_path, template)
    if VISION_FAMILIES[family].prompt_prefix:  # its settings, read as the exporter reads them (Janus's prompt)
        processor.save_pretrained(tmp_path)
    # GOT-OCR2's processor takes one image per prompt (more are pages of one document).
    images = [_image(1)] if family == "got_ocr2" else [_image(1), _image(2, 60, 30)]
    messages = _conversation(*images)
    want = hf_ids(processor, messages)
    per_image = want.count(IMAGE_TOKEN_ID) // len(images)
    assert per_image > 0 and "What is in this picture?" in processor.tokenizer.decode(want)
    assert kvforge_ids(family, tmp_path, template, messages, per_image) == want



def test_str_content_reaches_a_parts_template_as_one_text_part(tmp_path) -> None:
    """A str content (what OpenAI clients send for text) reaches a template that reads parts as one text part: the
    processor's ids of the same text as a part (transformers would pass the str, and LLaVA's template drops it)."""
    template = RELEASED_TEMPLATES["llava"]
    processor = hf_processor("llava", tmp_path, template)
    as_parts = _conversation(_image(1))
    as_str = [dict(m, content=m["content"][0]["text"]) if m["role"] == "assistant" else m for m in as_parts]
    as_str[-1] = dict(as_str[-1], content="Compare them.")
    want = hf_ids(processor, as_parts)
    assert kvforge_ids("llava", tmp_path, template, as_str, want.count(IMAGE_TOKEN_ID)) == want
    assert "ASSISTANT: A cat on a mat. USER: Compare them." in processor.tokenizer.decode(want)


# -- a LLaVA export whose checkpoint carries the released template and a processor saved as transformers 5 saves it --

NEW = 8


class Llava:
    """A tiny LLaVA checkpoint with llava-hf's chat template and "<image>" in its tokenizer, its processor saved in
    transformers' current layout (processor_config.json, no preprocessor_config.json), its export and the HF model."""

    def __init__(self, root: Path) -> None:
        from kvforge.exporter.export import export_model
        from kvforge.runtime import Generator
        from kvforge.tools.vlm_fixtures import build_tiny_vlm

        self.hf_dir, self.out = root / "hf", root / "export"
        self.model = build_tiny_vlm("llava", self.hf_dir)
        self.processor = hf_processor("llava", self.hf_dir, RELEASED_TEMPLATES["llava"])
        (self.hf_dir / "preprocessor_config.json").unlink()
        self.processor.save_pretrained(self.hf_dir)
        assert not (self.hf_dir / "preprocessor_config.json").exists()
        self.manifest = export_model(self.hf_dir, self.out)
        self.gen = Generator(self.out)

    def hf_answer(self, messages: list[dict], new: int = NEW, exact: bool = False) -> tuple[list[int], list[int]]:
        """The processor's ids of `messages` and HF's greedy tokens after them (`exact`: `new` tokens, EOS or not)."""
        import torch

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inputs = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True, return_tensors="pt")
            with torch.no_grad():
                out = self.model.generate(**inputs, max_new_tokens=new, do_sample=False,
                                          **({"min_new_tokens": new} if exact else {}))
        ids = inputs["input_ids"][0].tolist()
        return ids, out[0, len(ids):].tolist()

    def hf_text(self, messages: list[dict]) -> str:
        return self.processor.tokenizer.decode(self.hf_answer(messages)[1], skip_special_tokens=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Llava:
    return Llava(tmp_path_factory.mktemp("vlm-chat"))


@pytest.fixture(scope="module")
def server(llava):
    from serving import serving

    from kvforge.serve.app import create_app

    app = create_app(llava.out, max_batch=2, max_seq_len=256, model_name="vlm", prefill_chunk=16)
    with serving(app) as base:
        yield base


def _client(base: str):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


def _served(base: str, messages: list[dict], tokens: int = NEW) -> str:
    reply = _client(base).chat.completions.create(model="vlm", messages=messages, max_tokens=tokens, temperature=0)
    return reply.choices[0].message.content


def _url(png: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode()


def _openai(messages: list[dict]) -> list[dict]:
    """`messages` with each {"type": "image", "image": png bytes} part as OpenAI's image_url part."""
    return [dict(m, content=[{"type": "image_url", "image_url": {"url": _url(p["image"])}} if p["type"] == "image"
                             else p for p in m["content"]]) if isinstance(m["content"], list) else m for m in messages]


def test_a_processor_config_only_folder_exports_its_image_settings(llava, tmp_path) -> None:
    """transformers 5 saves a processor's image settings in processor_config.json alone: the export reads them there,
    as AutoImageProcessor does (the fixture's export was made from such a folder)."""
    from kvforge.exporter.vision import processor_record
    from kvforge.tools.vlm_fixtures import save_tiny_processor

    assert llava.manifest["vision"]["processor"]["class"] == "CLIPImageProcessor"
    save_tiny_processor("llava", tmp_path)  # the same settings as preprocessor_config.json
    assert llava.manifest["vision"]["processor"] == processor_record(tmp_path)
    (tmp_path / "preprocessor_config.json").unlink()
    with pytest.raises(InputError, match="no preprocessor_config.json .nor an image_processor entry"):
        processor_record(tmp_path)


def test_chats_answer_as_hf_greedy_on_the_processors_ids(llava, server, tmp_path) -> None:
    """Generator.chat, the server and `kvforge chat` answer a chat with an image part as HF's greedy generate does on
    the ids transformers' processor makes of it (llava-hf's template: the image, then the question)."""
    import json

    from click.testing import CliRunner

    from kvforge.cli import main
    from kvforge.runtime.media.image_prompt import expand_images

    png = _png(3)
    messages = [{"role": "user", "content": [{"type": "image", "image": _image(3)},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    ids, tokens = llava.hf_answer(messages, exact=True)
    mine, images = llava.gen.chat_inputs(_openai([dict(messages[0], content=[
        {"type": "image", "image": png}, messages[0]["content"][1]])]))
    assert expand_images(mine, len(images), llava.gen.images.vision, "the chat") == ids
    result = llava.gen.chat([{"role": "user", "content": [{"type": "image", "image": png},
                                                          {"type": "text", "text": "What is in this picture?"}]}],
                            max_new_tokens=NEW, greedy=True, ignore_eos=True)
    assert result.tokens[0] == tokens
    assert _served(server, _openai([dict(messages[0], content=[{"type": "image", "image": png},
                                                                 messages[0]["content"][1]])])) == \
        llava.hf_text(messages)

    picture = tmp_path / "picture.png"
    picture.write_bytes(png)
    out = CliRunner().invoke(main, ["chat", str(llava.out), "--max-new-tokens", str(NEW), "--greedy", "--json",
                                    "--quiet"], input=f"/image {picture}\nWhat is in this picture?\n")
    assert out.exit_code == 0, out.output
    turn = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    cli_messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                                 {"type": "image", "image": _image(3)}]}]
    assert turn["answer"] == llava.hf_text(cli_messages)


def test_typed_placeholder_text_stays_text(llava, server) -> None:
    """Only image parts make image places: "<image>" typed in a system prompt or an earlier turn is text (a 400
    before), as special-token text typed in a message already is."""
    png = _png(4)
    messages = [{"role": "system", "content": [{"type": "text", "text": "Answer about <image> tags too."}]},
                {"role": "user", "content": [{"type": "text", "text": "Is <image> a tag?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Yes: <image> is one."}]},
                {"role": "user", "content": [{"type": "image", "image": png}, {"type": "text", "text": "And this?"}]}]
    ids, images = llava.gen.chat_inputs(messages)
    token = llava.gen.images.vision["image_token_id"]
    assert len(images) == 1 and ids.count(token) == 1
    text = llava.gen.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.count("<image>") == 4  # three typed (as text) and the image part's place
    answer = llava.gen.chat(messages, max_new_tokens=NEW, greedy=True)
    assert _served(server, _openai(messages)) == answer.text[0]


def test_image_parts_in_any_role_are_taken_by_both_surfaces(llava, server) -> None:
    """transformers takes image parts in messages of any role (its template decides where they go): Generator.chat
    and the server both do (the server refused them outside user messages)."""
    png = _png(5)
    messages = [{"role": "system", "content": [{"type": "image", "image": png},
                                               {"type": "text", "text": "Describe images."}]},
                {"role": "user", "content": [{"type": "text", "text": "What did the system show?"}]}]
    answer = llava.gen.chat(messages, max_new_tokens=NEW, greedy=True)
    ids, images = llava.gen.chat_inputs(messages)
    assert len(images) == 1 and ids.count(llava.gen.images.vision["image_token_id"]) == 1
    assert _served(server, _openai(messages)) == answer.text[0]


def test_image_tokens_without_images_are_refused(llava, server) -> None:
    import openai

    token = llava.gen.images.vision["image_token_id"]
    with pytest.raises(InputError, match=f"holds 1 image token.s. .id {token}. but no images"):
        llava.gen.generate([[1, 40, token, 41]], max_new_tokens=2)
    with pytest.raises(openai.BadRequestError, match="but no images"):
        _client(server).completions.create(model="vlm", prompt=[1, 40, token, 41], max_tokens=2)


def test_a_crafted_chat_placeholder_is_refused_at_load(llava) -> None:
    import copy
    import json

    from kvforge.core.errors import ManifestError
    from kvforge.core.vision_manifest import check_vision_manifest as _check_vision

    manifest = json.loads((llava.out / "kvforge.json").read_text())
    assert manifest["vision"]["chat_placeholder"] == "<image>"
    _check_vision(manifest, llava.out, manifest["vision"]["image_token_id"] + 8)
    for bad in (5, ""):
        crafted = copy.deepcopy(manifest)
        crafted["vision"]["chat_placeholder"] = bad
        with pytest.raises(ManifestError, match="vision.chat_placeholder must be a text"):
            _check_vision(crafted, llava.out, manifest["vision"]["image_token_id"] + 8)


def test_generate_chat_renders_as_the_processor_with_or_without_an_image(llava, tmp_path) -> None:
    """`kvforge generate --chat` on a vision export renders through the processor's path too (the text as a text
    part, after the images): HF's greedy tokens on the processor's ids, with an image and without."""
    import json

    from click.testing import CliRunner

    from kvforge.cli import main

    picture = tmp_path / "picture.png"
    picture.write_bytes(_png(6))
    for image in (picture, None):
        parts = [{"type": "image", "image": _image(6)}] if image else []
        _, tokens = llava.hf_answer([{"role": "user", "content": [*parts, {"type": "text", "text": "Hello there"}]}],
                                    exact=True)
        out = CliRunner().invoke(main, ["generate", str(llava.out), "--chat", "Hello there", "--greedy", "--json",
                                        "--ignore-eos", "--max-new-tokens", str(NEW),
                                        *(["--image", str(image)] if image else [])])
        assert out.exit_code == 0, out.output
        assert json.loads(out.stdout)["tokens"][0] == tokens

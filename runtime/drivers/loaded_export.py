"""An export folder opened once: its manifest, tokenizer, vocabulary, chat template and backend, with the id
and control helpers and the NaN check every driver of it shares. The Generator (one request at a time per slot),
the Scheduler (continuous batching) and the GenerationService (the server's side) all take one.

    export = LoadedExport(folder)                        # or LoadedExport(folder, "ort-cuda", device_id=1)
    Generator(export).generate(...); Scheduler(export, max_batch=8)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.core.contract import ModelSpec
from kvforge.core.errors import InputError, KvforgeError, NumericalError
from kvforge.core.manifest import load_manifest
from kvforge.core.targets import Target, get_target
from kvforge.runtime.backends.backend import Backend, create_backend
from kvforge.runtime.controls.logit_controls import RowControls
from kvforge.runtime.controls.request import GenerationRequest
from kvforge.runtime.controls.sampling import SamplingConfig
from kvforge.runtime.drivers.images import Images, RowImages
from kvforge.runtime.text.chat import ChatTemplate, read_chat_template
from kvforge.runtime.text.prompts import Prompts, RenderedChat, as_id_list, is_int, parse_prompts
from kvforge.runtime.text.tokenizer import TOKENIZER_FILE, Tokenizer
from kvforge.runtime.text.vocabulary import Vocabulary

# Backends loaded in a thread beside the tokenizer (ONNX Runtime on the CPU; a CUDA or TensorRT
# context belongs to the thread that makes it, so those load on the caller's thread).
THREADED_LOAD = ("ort-cpu",)
NO_IMAGES = "{folder} takes no images: it was exported from a text model, or with --text-only"


class LoadedExport:
    """An export folder (`kvforge export` output) on a backend (runtime/backends/backend.py)."""

    def __init__(
        self,
        export_dir: str | Path,
        backend: str | Backend | None = None,
        *,
        verify_hashes: bool = False,
        **backend_options: Any,
    ) -> None:
        """`backend`: a name ("ort-cpu", "ort-cuda", "emulate", "tensorrt"), a Backend object, or None for
        the export's default (ort-cpu; emulate for a trt export). `backend_options` go to the backend
        (ONNX Runtime: threads, sessions, device_id, max_capacity; TensorRT: engine_dir, device_id,
        cuda_graphs); an option the backend does not have is an error. `verify_hashes` re-hashes
        every file, weights included, before loading."""
        self.folder = Path(export_dir)
        self.manifest = load_manifest(self.folder, verify_hashes=verify_hashes)
        if self.manifest.get("encoder") is not None:
            raise InputError(f"{self.folder} is an encoder-decoder export: load it with "
                             "kvforge.runtime.drivers.seq2seq.Seq2SeqGenerator (kvforge generate, transcribe and serve "
                             "take it as it is)")
        # Resolved once, here, where the manifest is read: the backend, heads and drivers ask this.
        self.target: Target = get_target(self.manifest["target"])
        model = ModelSpec.from_manifest(self.manifest)
        self.vocab_size = model.vocab_size
        # Padding rows only need a real id: -1 (Hugging Face's "none") or none at all pads with 0.
        self.pad_token_id = model.pad_token_id if model.pad_token_id is not None and model.pad_token_id >= 0 else 0
        generation = self.manifest.get("generation") or {}
        self.eos_token_ids = frozenset(as_id_list(list(model.eos_token_id))
                                       + as_id_list(generation.get("eos_token_id")))
        self.default_sampling = SamplingConfig.from_generation(generation)
        if backend is not None and not isinstance(backend, str) and backend_options:
            raise InputError("backend options go to create_backend() when passing a Backend object")
        name = (backend or self.target.default_backend) if backend is None or isinstance(backend, str) else None
        building: Future[Backend] | None = None
        if name in THREADED_LOAD:
            # ONNX Runtime builds a session (graph optimisation, weight prepacking: most of a cold
            # start) with the GIL released, so the tokenizer and chat template load meanwhile.
            with ThreadPoolExecutor(1, thread_name_prefix="kvforge-load") as pool:
                building = pool.submit(create_backend, name, self.folder, self.manifest, target=self.target,
                                       **backend_options)
                self._load_text()  # (leaving the block waits for the backend, also on an error here)
        else:
            self._load_text()
        self.vocabulary = Vocabulary(self.folder, self.tokenizer, self.vocab_size, self.pad_token_id,
                                     self.eos_token_ids)
        if building is not None:
            self.backend: Backend = building.result()  # its error, if any, raised here
        elif name is not None:
            self.backend = create_backend(name, self.folder, self.manifest, target=self.target, **backend_options)
        else:
            self.backend = backend
        self.backend_name = self.backend.name
        self.max_capacity = self.backend.limits.max_capacity
        # A vision-language export's image path (runtime/drivers/images.py); None: the export takes no images.
        tokenizer = self.tokenizer
        text_ids = None if tokenizer is None else lambda text, special: tokenizer.encode(text, special)
        self.images = Images(self.folder, self.manifest, model.bos_token_id,
                             encode=text_ids) if self.manifest.get("vision") else None

    def _load_text(self) -> None:
        """The tokenizer and the chat template."""
        self.tokenizer = Tokenizer(self.folder) if (self.folder / TOKENIZER_FILE).is_file() else None
        # The chat template is read and hashed once, here: a file swapped (or linked elsewhere) after
        # the load is never rendered. A broken one fails only the chat calls, with its message.
        self._chat_template: ChatTemplate | None = None
        self._chat_template_error: KvforgeError | None = None
        try:
            self._chat_template = read_chat_template(self.folder, self.manifest)
        except KvforgeError as err:
            self._chat_template_error = err

    def request(self, prompts: Prompts | GenerationRequest, *args: Any, **options: Any) -> GenerationRequest:
        """The GenerationRequest for `prompts` and GenerationRequest.create's options (max_new_tokens,
        sampling or greedy/temperature/top_k/top_p/min_p/seed/presence_penalty/frequency_penalty/
        repetition_penalty, stop_token_ids, stop, capacity, ignore_eos, keep_logits, speculate,
        draft_len, logprobs, n, grammar), the sampling keywords overriding this export's
        generation config. A GenerationRequest is returned as is (no options with it)."""
        if isinstance(prompts, GenerationRequest):
            if args or options:
                raise InputError("pass either a GenerationRequest or prompts with options, not both")
            return prompts
        return GenerationRequest.create(prompts, *args, defaults=self.default_sampling, **options)

    def chat_ids(self, messages: Any, add_generation_prompt: bool = True, tools: list[dict] | None = None,
                 special_tokens_in_content: bool = False, vision: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the export's chat template, as transformers'
        apply_chat_template(..., tokenize=True) gives them, except that special-token text inside a
        message's content ("<|im_end|>" typed by a user) stays text rather than becoming the control
        token (runtime/text/chat_tokens.py; `special_tokens_in_content=True`: parsed, as transformers does).
        `messages`: [{"role", "content"}, ...] or one user message as a str; `tools`: OpenAI's tool
        list, for templates that take one (kvforge.runtime.controls.tool_calls parses the calls out of the answer).
        `vision`: a vision-language export's record, for messages whose contents may hold {"type": "image"} parts
        (chat_inputs): rendered and tokenized as transformers' processor does (runtime/media/image_prompt.py
        vision_chat), each image place the template writes one image token."""
        from kvforge.runtime.controls.tool_calls import check_tools, template_takes_tools
        from kvforge.runtime.drivers.image_chat import image_chat_ids
        from kvforge.runtime.text.chat_tokens import conversation_ids
        from kvforge.runtime.text.messages import check_messages

        template = self.chat_template
        if tools is not None and not template_takes_tools(template.text):
            raise InputError(f"{template.source} does not support tools (it never reads a `tools` variable)")
        checked_tools = check_tools(tools) if tools is not None else None
        tokenizer = self.tokenizer
        assert tokenizer is not None  # checked by chat_template
        plain = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        render = lambda ms: template.render(ms, add_generation_prompt, checked_tools)  # noqa: E731
        if vision is None:
            return conversation_ids(render, check_messages(messages), tokenizer, plain, special_tokens_in_content)
        return image_chat_ids(render, check_messages(messages, content_parts=True), tokenizer, template, vision, plain,
                              special_tokens_in_content)

    def chat_inputs(self, messages: Any, add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    special_tokens_in_content: bool = False) -> tuple[list[int], list[Any]]:
        """chat_ids(), and a conversation's images: on a vision-language export, image content parts (OpenAI's
        image_url, or {"type": "image", "image": ...}, in a message of any role, as transformers takes them) reach
        the template as {"type": "image"} parts, and each image place it writes is one image token among the ids
        (runtime/media/image_prompt.py); the images are returned in order."""
        from kvforge.runtime.media.image_prompt import check_image_places, take_image_parts

        self.check_image_parts(messages)
        if self.images is None:
            return self.chat_ids(messages, add_generation_prompt, tools, special_tokens_in_content), []
        parts, images = take_image_parts(messages)
        ids = self.chat_ids(parts, add_generation_prompt, tools, special_tokens_in_content, self.images.vision)
        check_image_places(ids, images, self.images.vision, self.chat_template.source)
        return ids, images

    def check_image_parts(self, messages: Any) -> None:
        """InputError for image parts sent to an export that takes no images, or an image_url with a bad `detail`."""
        from kvforge.runtime.media.images import check_image_parts

        if check_image_parts(messages) and self.images is None:
            raise InputError(NO_IMAGES.format(folder=self.folder))

    @property
    def chat_template(self) -> ChatTemplate:
        """The chat template read at load, or the InputError/ManifestError saying why there is none."""
        if self.tokenizer is None:
            raise InputError(f"{self.folder} has no {TOKENIZER_FILE}, so it cannot chat; pass token ids")
        if self._chat_template_error is not None:
            raise self._chat_template_error
        if self._chat_template is None:
            raise InputError(f"{self.folder} has no chat template (the model's tokenizer came without one); "
                             "use a plain prompt instead")
        return self._chat_template

    def use_chat_template(self, template: ChatTemplate) -> None:
        """Render chats with `template` instead of the export's own (`kvforge chat --chat-template`; a
        runtime.text.chat.chat_template_override)."""
        self._chat_template, self._chat_template_error = template, None

    def prompt_ids(self, request: GenerationRequest) -> tuple[list[list[int]], bool]:
        """The request's prompts as token-id rows (checked against the vocabulary), and whether they
        came as text. Stop strings need the tokenizer."""
        if request.stop and self.tokenizer is None:
            raise InputError(f"stop strings need the export's {TOKENIZER_FILE}; {self.folder} has none")
        outside = sorted(t for t in request.stop_token_ids if not 0 <= t < self.vocab_size)
        if outside:  # the model can never emit them: such a stop would never stop anything
            raise InputError(f"stop_token_ids {outside[:8]} are not token ids of this model (0..{self.vocab_size - 1})")
        return parse_prompts(request.prompts, self.tokenizer, self.vocab_size, self.folder)

    def prompt_inputs(self, request: GenerationRequest) -> tuple[list[list[int]], bool, list[RowImages | None] | None]:
        """prompt_ids(), and with `request.images` each row's images (its places expanded among its ids)."""
        if request.images is None:
            rows, text_mode = self.prompt_ids(request)
            if self.images is not None:
                _refuse_image_tokens_without_images(rows, self.images.vision)
            return rows, text_mode, None
        if self.images is None:
            raise InputError(NO_IMAGES.format(folder=self.folder))
        prompts, images = _image_rows(request.prompts, request.images)
        if any(isinstance(p, str) for p in prompts) and self.tokenizer is None:
            raise InputError(f"{self.folder} has no {TOKENIZER_FILE}, so prompts must be token ids, not text")
        tokenizer = self.tokenizer
        encoded = self.images.encode_rows(images)  # first: an image's token count is known once it is encoded
        rows, encoded = self.images.prompt_rows(prompts, encoded,
                                                lambda text, special: tokenizer.encode(text, special))
        rows, _ = parse_prompts(rows, self.tokenizer, self.vocab_size, self.folder)  # the ids checked
        text_mode = isinstance(request.prompts, RenderedChat) or any(isinstance(p, str) for p in prompts)
        return rows, text_mode, self.images.row_images(rows, encoded)

    def checked_ids(self, ids: list[int]) -> list[int]:
        """One row of token ids, checked against the vocabulary (parse_prompts' messages)."""
        rows, _ = parse_prompts([list(ids)], self.tokenizer, self.vocab_size, self.folder)
        return rows[0]

    def grammar_matcher(self, grammar: Any) -> Any:
        """A fresh per-row matcher for the constraint spec `grammar` (request.grammar): the spec's
        `matcher(vocabulary)` (this export's Vocabulary); the matcher's `apply(logits_row)` masks,
        `advance(token)` moves on (runtime/controls/logit_controls.py)."""
        make = getattr(grammar, "matcher", None)
        if not callable(make):
            raise InputError(f"constrained decoding needs a grammar spec with a matcher(vocabulary) method (see "
                             f"kvforge.runtime.controls.constraint), got {type(grammar).__name__}")
        return make(self.vocabulary)

    def row_controls(self, request: GenerationRequest, prompt: list[int]) -> RowControls | None:
        """The penalties / grammar matcher of one row of `request`, or None when it has neither."""
        if not request.sampling.penalized and request.grammar is None:
            return None
        matcher = self.grammar_matcher(request.grammar) if request.grammar is not None else None
        return RowControls(request.sampling, prompt, matcher)

    def check_logits(self, logits: np.ndarray, step: int, greedy_picks: Sequence[int] | None = None) -> np.ndarray:
        """`logits` unchanged, or NumericalError if any is NaN (garbage tokens otherwise: say so
        instead of sampling token 0 forever). `greedy_picks`: each row's argmax of these very logits;
        argmax picks a row's first NaN, so only the picked logits need a look (a full pass over a cold
        [B, V] buffer costs ~0.1 ms, a few percent of a small model's decode step)."""
        if greedy_picks is not None:
            # Python scalars: cheaper than numpy's fancy indexing for a decode step's few rows.
            bad = False
            for b, pick in enumerate(greedy_picks):
                bad = bad or math.isnan(logits[b, pick])
        else:
            bad = np.isnan(logits).any()
        if bad:
            raise NumericalError(
                f"the model produced NaN logits at step {step}; the export may be corrupted: check it with "
                f"`kvforge inspect {self.folder} --verify` (or an fp16 export overflowed: try --dtype fp32)",
                step=step,
            )
        return logits



def _image_rows(prompts: Any, images: tuple[Any, ...]) -> tuple[list[Any], list[list[Any]]]:
    """Prompts as a list (text or token ids per row) and each row's images: one prompt takes `images` as its list,
    a batch takes a list per prompt."""
    if isinstance(prompts, RenderedChat):
        return [list(prompts.ids)], [list(images)]
    if isinstance(prompts, str) or (isinstance(prompts, list | tuple) and prompts and is_int(prompts[0])):
        return [prompts], [list(images)]
    if not isinstance(prompts, list | tuple) or not prompts:
        raise InputError("images go with a text prompt, a token-id prompt or a batch of them")
    if len(images) != len(prompts) or not all(isinstance(row, tuple | list) for row in images):
        raise InputError(f"a batch of {len(prompts)} prompts takes images as a list per prompt ({len(prompts)} "
                         "lists, [] for a prompt without)")
    return list(prompts), [list(row) for row in images]


def _refuse_image_tokens_without_images(rows: list[list[int]], vision: dict[str, Any]) -> None:
    """A prompt holding the image token with no images would run the image's places as plain embeddings, silently."""
    token = vision["image_token_id"]
    for i, row in enumerate(rows):
        if token in row:
            raise InputError(f"prompt {i} holds {row.count(token)} image token(s) (id {token}) but no images came with "
                             "it: pass the images (images=, --image) or leave the image token out")

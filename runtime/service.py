"""One export served over the continuous-batching Scheduler, in the runtime's own terms: what a front end
(kvforge serve's HTTP handlers, or any other) needs, and nothing of HTTP.

    service = GenerationService(Generator(folder), max_batch=8)
    ids = service.encode("Once upon a time", special=True)              # within the context, or CapacityError
    ids, tools = service.conversation(messages, tools, tool_choice, parallel)   # chat template + tool negotiation
    service.check_grammar(grammar)                                     # compiled now: a bad one is an InputError
    request = service.request(ids, max_tokens=16, stop=["\\n"], **sampling)
    handles = service.submit([request], on_event)                      # all queued, or none

Chat templates render in a killable child process with time and size limits (runtime/text/chat_worker.py);
grammars are compiled once per export and grammar (runtime/controls/constraint.py); tool-call formats and
forcing grammars come from runtime/controls/tool_calls.py. Errors are the runtime's (InputError, CapacityError,
QueueFullError, KvforgeError); a front end maps them to its own answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvforge.core.errors import CapacityError, InputError, KvforgeError
from kvforge.runtime.controls.constraint import compiler_for
from kvforge.runtime.controls.logprobs import TokenLogprob
from kvforge.runtime.controls.request import GenerationRequest
from kvforge.runtime.controls.tool_calls import ToolRequest, check_tool_support, detect_format, tool_request
from kvforge.runtime.drivers.handles import Event, RequestHandle
from kvforge.runtime.drivers.image_chat import image_chat_ids
from kvforge.runtime.drivers.loaded_export import LoadedExport
from kvforge.runtime.drivers.scheduler import Scheduler
from kvforge.runtime.text.chat import ChatTemplate, chat_template_override
from kvforge.runtime.text.chat_tokens import conversation_ids
from kvforge.runtime.text.chat_worker import RENDER_SECONDS, IsolatedRenderer
from kvforge.runtime.text.messages import check_messages, message_text
from kvforge.runtime.text.tokenizer import TokenPieces

PREFIX_CHARS_PER_TOKEN = 8  # a long text's prefix tokenized first: this many characters per context token
PREFIX_MARGIN_TOKENS = 64


class TemplateError(InputError):
    """The chat template could not render this conversation (its own error, or its limits)."""


class GenerationService:
    def __init__(self, export: LoadedExport | Any, *, max_batch: int = 8, max_seq_len: int | None = None,
                 prefill_chunk: int = 128, max_queue: int = 64, chat_template: str | Path | None = None,
                 template_seconds: float | None = None, special_tokens_in_content: bool = False,
                 **speculation: Any) -> None:
        """`export`: a LoadedExport (a Generator is taken for its `export`). `chat_template`: a Jinja file (or a built-in name, runtime/text/chat.py's BUILTIN_TEMPLATES) used
        instead of the export's; `template_seconds`: the time one rendering may take;
        `special_tokens_in_content`: special-token text in messages becomes control tokens (trusted
        clients only; by default it stays text, runtime/text/chat_tokens.py). `speculation`: the Scheduler's
        speculate, draft_len, draft and adaptive (runtime/drivers/scheduler_speculation.py)."""
        self.export: LoadedExport = getattr(export, "export", export)
        self.special_tokens_in_content = special_tokens_in_content
        # A template given in place of the export's: one that cannot be read fails the start.
        override = (chat_template_override(chat_template, self.export.folder, self.export.manifest)
                    if chat_template is not None else None)
        self.scheduler = Scheduler(self.export, max_batch=max_batch, max_seq_len=max_seq_len,
                                   prefill_chunk=prefill_chunk, max_queue=max_queue, **speculation).start()
        # The draft length of requests that name a method but no length: the server's, as its default's.
        self.draft_len: int | None = speculation.get("draft_len")
        self.capacity = self.scheduler.capacity
        self.max_queue = self.scheduler.max_queue
        self.tokenizer = self.export.tokenizer
        # No prompt of more characters than this can fit: a token never covers more characters than its
        # vocabulary string (x2 for normalizers that drop characters). Longer ones are refused untokenized.
        longest = self.tokenizer.longest_token_chars if self.tokenizer is not None else 1
        self.max_prompt_chars = self.capacity * max(longest, 1) * 2 + 1024
        self.template: ChatTemplate | None = None
        self.template_error: KvforgeError | None = None
        try:
            self.template = self.export.chat_template if override is None or self.tokenizer is None else override
        except KvforgeError as err:  # no template (or a broken one): chat requests get this message
            self.template_error = err
        self.pieces = TokenPieces(self.tokenizer)  # token texts and bytes for log-probabilities
        self.renderer = (IsolatedRenderer(self.template, seconds=template_seconds or RENDER_SECONDS).start()
                         if self.template is not None else None)
        # How the template writes tool calls (None: it takes no tools, or kvforge does not parse its format).
        self.tool_format = detect_format(self.template.text, self.renderer.render) if self.renderer is not None else None

    def close(self) -> None:
        self.scheduler.close()
        if self.renderer is not None:
            self.renderer.close()

    @property
    def default_greedy(self) -> bool:
        """Whether the export's generation config decodes greedily when a request says nothing."""
        return self.export.default_sampling.greedy

    # -- prompts ----------------------------------------------------------------------------------
    def encode(self, text: str, special: bool, what: str = "the prompt") -> list[int]:
        """`text`'s token ids (`special`: the tokenizer's BOS and the like), or CapacityError when it
        cannot fit the context (checked on its length before tokenizing), InputError when it cannot be
        tokenized."""
        if self.tokenizer is None:
            raise InputError("this export has no tokenizer: send the prompt as token ids")
        if len(text) > self.max_prompt_chars:
            raise CapacityError(self.too_long(what, f"{len(text)} characters"))
        self._refuse_by_prefix(text, what)
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=special)
        except KvforgeError:
            raise
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 (the tokenizer's Rust panics are BaseExceptions)
            raise InputError(f"the tokenizer could not encode {what}: {type(err).__name__}: {err}"[:300]) from None
        self.check_length(ids, what)
        return ids

    def _refuse_by_prefix(self, text: str, what: str) -> None:
        """CapacityError when a prefix of `text` (PREFIX_CHARS_PER_TOKEN characters per token of the
        context, cut at whitespace) already has more tokens than the context holds: a text far too long
        is refused after tokenizing that much, not all of it (600K characters: 0.4 s of a core each)."""
        limit = self.capacity * PREFIX_CHARS_PER_TOKEN
        if len(text) <= limit:
            return
        cut = max(text.rfind(" ", 0, limit), text.rfind("\n", 0, limit))
        if cut <= 0:
            return  # no word boundary to cut at: the whole text is tokenized
        # Pre-tokenizers split at whitespace, so the tokens before the cut are the text's own; the margin
        # covers a normalizer that merges across it.
        head = len(self.tokenizer.encode(text[:cut], add_special_tokens=False))
        if head > self.capacity + PREFIX_MARGIN_TOKENS:
            raise CapacityError(self.too_long(what, f"more than {head} tokens"))

    def check_length(self, ids: Sequence[int], what: str = "the prompt") -> None:
        if len(ids) > self.capacity:
            raise CapacityError(self.too_long(what, f"{len(ids)} tokens"))

    def check_ids(self, ids: Sequence[int]) -> None:
        """InputError for a token id outside the vocabulary, before the request is queued."""
        vocab = self.export.vocab_size
        outside = next((pos for pos, token in enumerate(ids) if not 0 <= token < vocab), None)
        if outside is not None:
            raise InputError(f"the prompt's position {outside} has token id {ids[outside]}, outside the vocabulary "
                             f"[0, {vocab})")

    def too_long(self, what: str, size: str) -> str:
        return f"{what} ({size}) does not fit this server's context of {self.capacity} tokens; shorten it"

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids)) if self.tokenizer is not None else ""

    def tools(self, tools: Any, tool_choice: Any, parallel: Any, messages: list[dict]) -> ToolRequest | None:
        """The request's tools negotiated with the template (None: no tools); InputError if they cannot be."""
        if self.template is None:
            raise InputError(str(self.template_error))
        request = tool_request(tools, tool_choice, parallel, self.template.text, self.tool_format, self.template.source)
        if any("tool_calls" in m for m in messages):  # a template that ignores them would drop them
            check_tool_support(self.template.text, self.tool_format, self.template.source)
        return request

    def conversation(self, messages: list[dict], tools: ToolRequest | None,
                     vision: dict[str, Any] | None = None) -> list[int]:
        """A checked conversation rendered with the template (its child process) and tokenized. `vision`: a
        vision-language export's record, for messages whose contents may hold {"type": "image"} parts: rendered and
        tokenized as transformers' processor does, each image place the template writes one image token
        (runtime/media/image_prompt.py vision_chat)."""
        if self.renderer is None:
            raise InputError(str(self.template_error))
        checked = check_messages(messages, content_parts=vision is not None)
        texts = [message_text(message["content"]) for message in checked]
        chars = sum(map(len, texts))
        if chars > self.max_prompt_chars:
            raise CapacityError(self.too_long("the conversation", f"{chars} characters"))
        # The messages' own text is in the rendered conversation: refused before the render when too long.
        self._refuse_by_prefix("\n".join(texts), "the conversation")
        renderer, template_tools = self.renderer, tools.template_tools if tools is not None else None

        def render(messages: list[dict]) -> str:
            try:
                return renderer.render(messages, True, template_tools)
            except InputError as err:
                raise TemplateError(str(err)) from err

        self._check_names_are_written(render, checked)
        plain: Callable[[str], list[int]] = lambda text: self.encode(text, False, "the conversation")  # noqa: E731
        if vision is None:
            ids = conversation_ids(render, checked, self.tokenizer, plain, self.special_tokens_in_content)
        else:
            ids = image_chat_ids(render, checked, self.tokenizer, self.template, vision, plain,
                                 self.special_tokens_in_content)
        self.check_length(ids, "the conversation")
        return ids

    def conversation_with_images(self, messages: list[dict], tools: ToolRequest | None) -> tuple[list[int], list[Any]]:
        """conversation(), and the images of its image content parts (a vision-language export): each part reaches
        the template as {"type": "image"}, whose place the tokenized conversation holds as one image token; the images
        are read, checked and encoded here (InputError for a bad one), so admission only finds their features."""
        from kvforge.runtime.media.image_prompt import check_image_places, take_image_parts

        images_path = self.export.images
        self.export.check_image_parts(messages)  # a text export refuses image parts as such; image_url.detail
        if images_path is None:
            return self.conversation(messages, tools), []
        parts, images = take_image_parts(messages)
        if len(images) > images_path.limits.max_images:
            raise InputError(f"{len(images)} images in one request; this server takes at most "
                             f"{images_path.limits.max_images}")
        ids = self.conversation(parts, tools, images_path.vision)  # the text is checked before any image is read
        check_image_places(ids, images, images_path.vision, self.template.source)
        if not images:
            return ids, []
        return ids, images_path.encode(images)  # read and encoded on this thread: admission only takes the features

    @staticmethod
    def _check_names_are_written(render: Callable[[list[dict]], str], messages: list[dict]) -> None:
        """OpenAI's `name` of a participant is used when the template writes it; a template that never
        does would drop it without a word, so such a request is refused (one more rendering, only for
        messages that carry a name). A tool message's name is only a label (tool_call_id pairs it)."""
        named = [i for i, m in enumerate(messages) if m.get("name") is not None and m["role"] != "tool"]
        if not named:
            return
        bare = [{k: v for k, v in m.items() if k != "name"} if i in named else m for i, m in enumerate(messages)]
        if render(bare) == render(messages):
            raise InputError(f"messages[{named[0]}].name is not written by this model's chat template, so it would "
                             "be ignored; leave 'name' out (or put the name in the content)")

    def prompt_logprobs(self, ids: list[int], top: int) -> list[TokenLogprob | None]:
        """The prompt's log-probabilities, scored by the scheduler's thread (its staging cache, its max_seq_len)."""
        return self.scheduler.score(ids, top).result()

    # -- requests ---------------------------------------------------------------------------------
    def check_grammar(self, grammar: Any) -> None:
        """Compile `grammar` now (cached; the scheduler's rows copy the result): a grammar that cannot be
        compiled is an InputError at admission, not a failure mid-generation."""
        compiler_for(self.export.vocabulary).compile(grammar)

    def request(self, prompt_ids: list[int], max_new_tokens: int, **options: Any) -> GenerationRequest:
        """The GenerationRequest (Generator.request's keywords, resolved against the export's sampling; `images`: a
        conversation's, from conversation_with_images)."""
        return self.export.request(prompt_ids, max_new_tokens, **options)

    def submit(self, requests: Sequence[GenerationRequest | None],
               on_event: Callable[[int, Event], None]) -> list[RequestHandle]:
        """Queue every request (all or none; None: nothing to generate): their handles. Events come to
        `on_event(position, event)` in the scheduler's thread."""
        handles: list[RequestHandle] = []
        try:
            for p, request in enumerate(requests):
                if request is not None:
                    handles.append(self.scheduler.submit(request, on_event=lambda e, p=p: on_event(p, e)))
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        return handles

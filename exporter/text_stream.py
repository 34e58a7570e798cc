"""A multimodal checkpoint's text model streamed from its shards, as a text checkpoint's is.

A vision-language (or any multimodal) checkpoint keeps its text decoder under a prefix (`model.language_model.`,
`language_model.model.`, ...) beside its tower's tensors, and its config nests the decoder's. The streamed export
(exporter/lazy_weights.py) finds each parameter's tensor by the parameter's own name, so such a checkpoint used to
be loaded whole (a 7B text model in fp16 held at once). `TextCheckpoint` is the checkpoint seen as its text model
alone: the causal-LM class's names (text_model.text_tensor_names, the same renaming the whole-model load does),
each read from the checkpoint's own tensor; the tower's tensors are not in it. `stream_text_model` builds the
empty model over that view and points each initializer back at the checkpoint's own tensor name, so the graphs
read the shards exactly as a text export's do.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from kvforge.exporter.checkpoint import COMPUTE_DTYPES, TensorInfo, _is_compute_matrix


class TextCheckpoint:
    """The text-model tensors of a multimodal checkpoint under the causal-LM class's parameter names (the
    exporter.checkpoint.Checkpoint interface the streamed export reads): `original[name]` is the checkpoint's name."""

    def __init__(self, checkpoint: Any, original: dict[str, str]) -> None:
        self.checkpoint = checkpoint
        self.original = dict(original)
        self.model_dir: Path = checkpoint.model_dir
        self.names: list[str] = sorted(self.original)
        infos = [checkpoint.info(name) for name in self.original.values()]
        self.files: list[Path] = sorted({info.file for info in infos})
        self.nbytes: int = sum(info.nbytes for info in infos)
        self.largest_nbytes: int = max((info.nbytes for info in infos), default=0)
        matrices = [info.dtype for info in infos if _is_compute_matrix(info)]
        self.dtype: str | None = COMPUTE_DTYPES[matrices[0]] if matrices else checkpoint.dtype

    def info(self, name: str) -> TensorInfo:
        """The TensorInfo of the checkpoint tensor that holds the text model's `name`."""
        if name not in self.original:
            raise KeyError(f"{name!r} is not a tensor of the text model in {self.model_dir}")
        return self.checkpoint.info(self.original[name])

    def read(self, name: str) -> Any:
        return self.checkpoint.read(self.original[name])

    def __contains__(self, name: object) -> bool:
        return name in self.original

    def __len__(self) -> int:
        return len(self.original)


def text_checkpoint(config: Any, checkpoint: Any) -> tuple[Any, TextCheckpoint, type] | str:
    """The text config to build the empty model from (a copy, its lm_head tied where the checkpoint stores none, as
    text_model.load_text_model does), the checkpoint seen as its text model and the causal-LM class; or why not."""
    from kvforge.exporter.text_model import BACKBONE_PREFIXES, text_tensor_names

    config = copy.deepcopy(config)
    cls, wanted, prefix, head = text_tensor_names(config, checkpoint.names)
    if prefix is None:
        return f"the checkpoint has no text-model tensors under {', '.join(BACKBONE_PREFIXES)}"
    config.tie_word_embeddings = not head
    return config, TextCheckpoint(checkpoint, wanted), cls


def stream_text_model(config: Any, torch_dtype: Any, checkpoint: Any, family: Any) -> tuple[Any, str | None]:
    """lazy_weights.empty_model for a multimodal checkpoint's text model: the causal-LM class kvforge exports
    (text_model's), its parameters found in the checkpoint by their renamed tensors; the EmptyModel's sources are
    the checkpoint's own tensor names, so the graphs read the shards directly. Or None and why not."""
    from kvforge.exporter.lazy_weights import empty_model

    found = text_checkpoint(config, checkpoint)
    if isinstance(found, str):
        return None, found
    text_config, view, cls = found
    empty, why = empty_model(text_config, torch_dtype, view, family, model_class=cls)
    if empty is not None:
        empty.sources = {name: view.original[source] for name, source in empty.sources.items()}
    return empty, why

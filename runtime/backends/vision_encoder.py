"""A vision-language export's `vision.onnx` on ONNX Runtime CPU: one preprocessed image in, its image tokens'
embeddings out (contract.GraphIO.vision()). Its graph is read from the bytes the manifest's sha256 checks, its
weights from the export's shared weights file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from kvforge.core.contract import IMAGE_FEATURES, PIXEL_VALUES, VISION, GraphIO
from kvforge.core.errors import ManifestError
from kvforge.core.manifest import read_graph
from kvforge.runtime.backends.ort_sessions import default_threads, feature_dtype


def _session(folder: Path, manifest: dict[str, Any], threads: int | None) -> ort.InferenceSession:
    """vision.onnx on ONNX Runtime CPU, from the bytes the manifest checks, its weights from the shared file."""
    options = ort.SessionOptions()
    threads = threads if threads is not None else default_threads()
    if threads is not None:
        options.intra_op_num_threads = threads
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(read_graph(folder, manifest, VISION), sess_options=options,
                                providers=["CPUExecutionProvider"])


class VisionEncoder:
    """encode(pixels [C, H, W] float32) -> features [tokens_per_image, hidden] in the export's dtype."""

    def __init__(self, folder: Path, manifest: dict[str, Any], threads: int | None = None) -> None:
        self.session = _session(folder, manifest, threads)
        have = ([i.name for i in self.session.get_inputs()], [o.name for o in self.session.get_outputs()])
        want = GraphIO.vision()
        if tuple(have[0]) != want.inputs or tuple(have[1]) != want.outputs:
            raise ManifestError(f"{folder}/vision.onnx has IO {have}, not {want.inputs} -> {want.outputs}; the "
                                "folder was modified, re-run the export")
        vision = manifest["vision"]
        self.shape = (vision["channels"], *vision["image_size"])
        self.tokens, self.hidden = vision["tokens_per_image"], vision["hidden_size"]
        # The graph's own shapes against the record, before any image is preprocessed by the record.
        for value, want, fields in ((self.session.get_inputs()[0], [1, *self.shape], "channels and vision.image_size"),
                                    (self.session.get_outputs()[0], [self.tokens, self.hidden],
                                     "tokens_per_image and vision.hidden_size")):
            if len(value.shape) != len(want) or any(isinstance(d, int) and d != w for d, w in zip(value.shape, want,
                                                                                                   strict=True)):
                raise ManifestError(f"{folder}/kvforge.json: vision.{fields} say {value.name} {want}, but vision.onnx "
                                    f"takes {value.shape}; the manifest was modified: re-run the export")
        self.dtype = feature_dtype(manifest)

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        if pixels.shape != self.shape:
            raise ValueError(f"pixels of shape {pixels.shape}, the vision graph takes {self.shape}")
        out = self.session.run([IMAGE_FEATURES], {PIXEL_VALUES: pixels[None].astype(self.dtype)})[0]
        if out.shape != (self.tokens, self.hidden):
            raise ManifestError(f"vision.onnx gave features of shape {out.shape}, its manifest says "
                                f"{(self.tokens, self.hidden)}; re-run the export")
        return out


class PatchEncoder:
    """A tower that takes each image at its own size (Qwen2-VL's): encode(pixel_values [patches, C*T*P*P], the
    tower's other inputs, tokens) -> features [tokens, hidden]. The other inputs (the tower's positions and attention
    segments, named as the manifest records them) come from the image's grid (runtime/media/mrope.py)."""

    def __init__(self, folder: Path, manifest: dict[str, Any], threads: int | None = None) -> None:
        self.session = _session(folder, manifest, threads)
        vision = manifest["vision"]
        self.inputs = tuple(vision["tower_inputs"])
        have = ([i.name for i in self.session.get_inputs()], [o.name for o in self.session.get_outputs()])
        want = GraphIO.vision(self.inputs)
        if tuple(have[0]) != want.inputs or tuple(have[1]) != want.outputs:
            raise ManifestError(f"{folder}/vision.onnx has IO {have}, not {want.inputs} -> {want.outputs}; the "
                                "folder was modified, re-run the export")
        self.hidden = vision["hidden_size"]
        self.dtype = feature_dtype(manifest)

    def encode(self, pixels: np.ndarray, arrays: dict[str, np.ndarray], tokens: int) -> np.ndarray:
        """`arrays`: the tower's other inputs by name (the runtime's media computes them from the image's grid);
        `tokens`: how many the image gives."""
        feeds = {PIXEL_VALUES: pixels.astype(self.dtype), **{name: arrays[name] for name in self.inputs}}
        out = self.session.run([IMAGE_FEATURES], feeds)[0]
        if out.shape != (tokens, self.hidden):
            raise ManifestError(f"vision.onnx gave features of shape {out.shape}, not {(tokens, self.hidden)}; re-run "
                                "the export")
        return out


class TileEncoder:
    """A tiled family's tower (InternVL's, ...): encode(tiles [N, C, H, W]) -> (features [rows, hidden], the graph's
    extra outputs), one image's tiles as one batch (the manifest's vision record: `input: "tiles"`)."""

    def __init__(self, folder: Path, manifest: dict[str, Any], threads: int | None = None) -> None:
        self.session = _session(folder, manifest, threads)
        vision = manifest["vision"]
        self.extras = tuple(vision.get("extra_outputs") or ())
        have = ([i.name for i in self.session.get_inputs()], [o.name for o in self.session.get_outputs()])
        want = GraphIO.vision((), self.extras)
        if tuple(have[0]) != want.inputs or tuple(have[1]) != want.outputs:
            raise ManifestError(f"{folder}/vision.onnx has IO {have}, not {want.inputs} -> {want.outputs}; the "
                                "folder was modified, re-run the export")
        self.hidden = vision["hidden_size"]
        size = vision.get("image_size")
        self.shape = (vision["channels"], *(size or (None, None)))
        pixels, features = self.session.get_inputs()[0].shape, self.session.get_outputs()[0].shape
        if len(pixels) != 4 or any(isinstance(d, int) and w is not None and d != w
                                   for d, w in zip(pixels[1:], self.shape, strict=True)) \
                or len(features) != 2 or (isinstance(features[1], int) and features[1] != self.hidden):
            raise ManifestError(f"{folder}/kvforge.json: vision.channels, image_size and hidden_size say "
                                f"{PIXEL_VALUES} [tiles, {', '.join(map(str, self.shape))}] -> [rows, {self.hidden}], "
                                f"but vision.onnx takes {pixels} -> {features}; re-run the export")
        self.outputs = list(want.outputs)
        self.dtype = feature_dtype(manifest)

    def encode(self, tiles: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        if tiles.ndim != 4 or any(w is not None and d != w for d, w in zip(tiles.shape[1:], self.shape, strict=True)):
            raise ValueError(f"tiles of shape {tiles.shape}, the vision graph takes [tiles, {self.shape}]")
        out = self.session.run(self.outputs, {PIXEL_VALUES: tiles.astype(self.dtype)})
        if out[0].ndim != 2 or out[0].shape[1] != self.hidden:
            raise ManifestError(f"vision.onnx gave features of shape {out[0].shape}, not [rows, {self.hidden}]; "
                                "re-run the export")
        return out[0], list(out[1:])

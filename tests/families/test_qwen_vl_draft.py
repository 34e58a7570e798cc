"""Draft-model speculation on a Qwen2.5-VL target (M-RoPE rows: prefill positions [3, B, S], decode rope_deltas):
the draft is the checkpoint's own --text-only export (the same tokenizer and vocabulary, plain positions, no images;
it reads an image's placeholder ids as tokens). Greedy tokens with images equal those without speculation, for
one image, two images of different sizes, text requests, and the Scheduler's concurrent rows (each with its own
rope_deltas); drafts are accepted. A vision export as the draft is one InputError."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_vision_language import _image  # noqa: E402
from vlm_testing import tiny_vlm_export  # noqa: E402

pytestmark = pytest.mark.xdist_group("qwen-vl-draft")  # the target and its draft exported once, on one worker
# Images of different sizes and aspect ratios: grids (1, 4, 6), (1, 10, 6) and (1, 6, 6) at the fixture's bounds.
IMAGES = ((3, 60, 90), (4, 130, 70), (5, 80, 80))
NEW = 24


class Pair:
    """The tiny Qwen2.5-VL checkpoint's whole export (the target) and its --text-only export (the draft)."""

    def __init__(self, shared: Path, root: Path) -> None:
        from kvforge.exporter.export import export_model
        from kvforge.runtime import Generator

        self.target, self.draft = shared / "export", root / "draft"
        export_model(shared / "hf", self.draft, text_only=True)
        self.plain = Generator(self.target)
        self.gen = Generator(self.target, draft=self.draft)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    return Pair(tiny_vlm_export(tmp_path_factory, "qwen2_5_vl"), tmp_path_factory.mktemp("qwen-vl-draft"))


def _images(*which: int) -> list:
    return [_image(*IMAGES[i]) for i in which]


def _both(pair: Pair, prompts, images, new: int = NEW):
    """Plain greedy and draft-model greedy results of the same request."""
    options = {"max_new_tokens": new, "greedy": True, "ignore_eos": True}
    plain = pair.plain.generate(prompts, images=images, **options)
    drafted = pair.gen.generate(prompts, images=images, speculate="draft", draft_len=3, **options)
    return plain, drafted


def test_the_draft_is_a_text_export_and_the_target_takes_mrope_positions(pair):
    assert pair.plain.manifest["vision"]["positions"] == "mrope"
    assert pair.gen.draft.export.manifest.get("vision") is None
    prefill = [entry["name"] for entry in pair.gen.draft.export.manifest["graphs"]["prefill"]["inputs"]]
    assert "position_ids" not in prefill  # the draft's own positions are plain


@pytest.mark.parametrize("count", [1, 2])
def test_greedy_tokens_with_images_equal_plain_and_drafts_are_accepted(pair, count):
    pieces = ["Describe ", *[" and then "] * (count - 1), " in a few words, one two three one two three"]
    plain, drafted = _both(pair, "<image>".join(pieces), _images(*range(count)))
    assert drafted.tokens == plain.tokens
    assert drafted.draft_tokens > 0 and drafted.verify_steps > 0
    assert drafted.accepted_tokens > 0  # the text draft's guesses held at the target's M-RoPE positions


def test_text_requests_with_the_draft_equal_plain(pair):
    plain, drafted = _both(pair, "Once upon a time there was a", None)
    assert drafted.tokens == plain.tokens
    # No image: the draft is the target's own text model, so it drafts what the target picks.
    assert drafted.accepted_tokens == drafted.draft_tokens > 0


def test_the_scheduler_drafts_for_concurrent_rows_with_different_rope_deltas(pair):
    """Rows in one batch with different images (and counts): each its own rope_deltas. (The Generator's batch
    cannot speculate on an `ort` export: its GroupQueryAttention verifies one row per call; the Scheduler verifies
    row by row.)"""
    import threading

    from kvforge.runtime.drivers.scheduler import Scheduler

    prompts = ["<image> What is this? one two one two", "Look at it: <image> and tell me what the picture shows",
               "Two: <image> and <image>, compare them, one two one two"]
    images = [_images(0), _images(1), _images(2, 0)]
    want = [pair.plain.generate(p, images=im, max_new_tokens=16, greedy=True, ignore_eos=True).tokens[0]
            for p, im in zip(prompts, images, strict=True)]
    assert len({tuple(t) for t in want}) == 3
    scheduler = Scheduler(pair.gen.export, max_batch=4, max_seq_len=256, prefill_chunk=8, speculate="draft",
                          draft_len=3, draft=pair.gen.draft).start()
    try:
        got: list = [None] * 3

        def ask(i: int) -> None:
            request = pair.gen.request(prompts[i], 16, greedy=True, ignore_eos=True, images=images[i])
            got[i] = scheduler.submit(request).result()[0]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert got == want
        assert scheduler.stats["draft_tokens"] > 0 and scheduler.stats["accepted_tokens"] > 0
    finally:
        scheduler.close()


def test_a_vision_export_as_the_draft_is_refused(pair, tmp_path):
    from kvforge.core.errors import InputError
    from kvforge.runtime import Generator

    copy = shutil.copytree(pair.target, tmp_path / "vision-draft")
    with pytest.raises(InputError, match="takes no images; export the draft model with --text-only"):
        Generator(pair.target, draft=copy)

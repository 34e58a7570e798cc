"""`kvforge serve`'s app on two vision-language families (Qwen2.5-VL: images at their own size with M-RoPE rows;
InternVL: images tiled as released): 16 concurrent OpenAI chat requests with different images of different sizes,
each answer equal to its solo answer (greedy), and the server's RSS flat over three more rounds of 16 after a
warm-up round (the server runs in this process: its RSS is this process's)."""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serving import data_url  # noqa: E402
from vlm_served import chat, message, png, served_app, served_export  # noqa: E402

pytestmark = pytest.mark.xdist_group("vlm-served")  # each family's export made once, on one worker
FAMILIES = ("qwen2_5_vl", "internvl")
REQUESTS = 16
ROUNDS = 3
# RSS may grow by less than this over ROUNDS rounds of REQUESTS after the warm-up round: 48 requests that each
# kept a few hundred KiB (a decoded image, its features, its pixel values) stay under it, but a slot's cache or an
# encoder's arena kept per request (megabytes each at the server's sizes) would not. The figures are printed.
RSS_BOUND_MIB = 64
# Sizes that give the families different grids (Qwen: 4..36 merged tokens) and tile counts (InternVL: 1..4 + 1).
SIZES = [(28 + 17 * i, 300 - 15 * i) for i in range(REQUESTS)]


def rss_mib() -> float:
    """This process's resident set size in MiB (/proc/self/status VmRSS)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _messages(seed: int) -> list[list[dict]]:
    """REQUESTS conversations, each with its own image (its own size) and words."""
    return [[message(f"Picture {i}: what is in it?", data_url(png(seed + i, *SIZES[i])))] for i in range(REQUESTS)]


def _together(base: str, conversations: list[list[dict]]) -> list[str]:
    with ThreadPoolExecutor(len(conversations)) as pool:
        return list(pool.map(lambda c: chat(base, c), conversations))


@pytest.fixture(scope="module", params=FAMILIES)
def server(request, tmp_path_factory):
    with served_app(served_export(tmp_path_factory, request.param)) as (base, app):
        yield request.param, base, app


def test_sixteen_concurrent_requests_answer_as_each_alone_and_rss_stays_flat(server, record_property):
    family, base, app = server

    def round_equals_alone(seed: int, alone_first: bool) -> None:
        # New images each round. The one asked first prefills fresh, the other may take its prefix from the store:
        # the warm-up round checks fresh solo answers, the later rounds fresh concurrent ones.
        conversations = _messages(seed)
        alone = [chat(base, c) for c in conversations] if alone_first else None
        together = _together(base, conversations)
        alone = alone or [chat(base, c) for c in conversations]
        assert together == alone
        assert len(set(alone)) > REQUESTS // 2  # the images matter

    round_equals_alone(100, alone_first=True)  # the warm-up round: arenas, caches, prefix store at working sizes
    gc.collect()
    before = rss_mib()
    for r in range(ROUNDS):
        round_equals_alone(1000 * (r + 1), alone_first=False)
    gc.collect()
    after = rss_mib()
    record_property(f"{family}_rss_mib", (round(before, 1), round(after, 1)))
    print(f"{family}: RSS {before:.1f} MiB after the warm-up round, {after:.1f} MiB after {ROUNDS} more rounds of "
          f"{REQUESTS} ({after - before:+.1f} MiB)")
    assert after - before < RSS_BOUND_MIB
    snapshot = app.state.service.scheduler.snapshot()
    assert snapshot["running"] == 0 and snapshot["waiting"] == 0

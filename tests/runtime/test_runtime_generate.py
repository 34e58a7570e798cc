"""End to end: a built-in tiny model exported by kvforge, run by the Generator, against HF eager."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvforge.core.errors import CapacityError, InputError  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402
from kvforge.runtime.drivers import inspection  # noqa: E402

RECIPE = "llama-tiny"
NEW_TOKENS = 32
PROMPTS = [[1, 50, 60, 70, 80, 90, 100, 110, 120], [1, 33, 44], [1, 7, 300, 301, 5, 6]]


@pytest.fixture(scope="module")
def folders(hf_folder, exported) -> tuple[Path, Path]:
    return hf_folder(RECIPE), exported(RECIPE, "ort", "fp32")


@pytest.fixture(scope="module")
def fp16_export(exported) -> Path:
    return exported(RECIPE, "ort", "fp16")


@pytest.fixture(scope="module")
def hf_model(folders):
    return transformers.AutoModelForCausalLM.from_pretrained(folders[0], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(hf_model) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = hf_model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, do_sample=False,
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.fixture(scope="module")
def gen(folders) -> Generator:
    return Generator(folders[1], threads=2)


def test_prefill_logits_match_hf(gen, hf_model) -> None:
    # Tokens can agree by luck; logits cannot. Drive the backend directly for one prefill.
    slot = gen.backend.allocate(1, 16)
    prompt = PROMPTS[0]
    logits = gen.backend.prefill(slot, np.array([prompt]), np.array([len(prompt) - 1])).copy()
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1].numpy()
    np.testing.assert_allclose(logits[0], ref, rtol=1e-4, atol=1e-4)


def test_greedy_matches_hf_eager_per_prompt(gen, hf_greedy) -> None:
    for prompt, want in zip(PROMPTS, hf_greedy, strict=True):
        result = gen.generate([prompt], max_new_tokens=NEW_TOKENS, greedy=True)
        assert result.tokens == [want]


def test_batch_of_different_lengths_matches_each_prompt_alone(gen, hf_greedy) -> None:
    result = gen.generate(PROMPTS, max_new_tokens=NEW_TOKENS, greedy=True)
    assert result.tokens == hf_greedy
    assert result.prompt_tokens == [len(p) for p in PROMPTS]


def test_text_prompt_uses_the_folders_tokenizer(gen, folders, hf_model) -> None:
    hf_tok = transformers.AutoTokenizer.from_pretrained(folders[0])
    text = "The quick brown fox"
    ids = hf_tok(text)["input_ids"]
    result = gen.generate(text, max_new_tokens=8)
    assert result.prompt_tokens == [len(ids)]
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
    assert result.tokens == [want]
    assert result.text == [hf_tok.decode(want, skip_special_tokens=True)]


def test_kv_buffers_stay_bound_across_decode_steps(gen) -> None:
    stream = gen.stream(PROMPTS[:2], max_new_tokens=NEW_TOKENS, greedy=True, stop_token_ids=[])
    addresses = inspection.kv_addresses(gen)
    runs_before = gen.runs
    steps = 0
    for event in stream:
        phase = "prefill" if event.step == 0 else "decode"
        bound = inspection.bound_output_addresses(gen, phase)
        assert {n.replace("present", "past"): a for n, a in bound.items() if n != "logits"} == addresses
        steps += 1
    assert inspection.kv_addresses(gen) == addresses
    assert gen.runs["decode"] - runs_before["decode"] == stream.result.steps == steps - 1


@pytest.mark.parametrize(
    ("prompts", "kwargs", "error", "message"),
    [
        ([[]], {}, InputError, "prompt 0 has no tokens"),
        ("", {}, InputError, "prompt 0 is empty"),
        (["ok", "caf\udce9"], {}, InputError, "prompt 1 is not valid UTF-8 text"),
        ([b"hello"], {}, InputError, "prompt 0 is bytes; pass text as str"),
        ("hi", {"temperature": 0.5, "seed": -3}, InputError, "seed must be an integer >= 0"),
        ([[1, 512]], {}, InputError, "token id 512, outside the vocabulary [0, 512)"),
        ([[1] * 2040], {"max_new_tokens": 10}, CapacityError, "needs 2049 positions"),
        ([[1] * 8], {"max_new_tokens": 8, "capacity": 10}, CapacityError,
         "needs 15 positions but the KV cache holds 10; raise capacity (max 2048)"),
    ],
)
def test_bad_requests(gen, prompts, kwargs, error, message) -> None:
    with pytest.raises(error) as info:
        gen.generate(prompts, **kwargs)
    assert message in str(info.value)


def test_last_cache_slot_is_never_touched(gen) -> None:
    # Only the new rows are written in place: a marker beyond every row's tokens survives.
    stream = gen.stream(PROMPTS, max_new_tokens=8, greedy=True, capacity=40, stop_token_ids=[])
    layers = gen.manifest["kv_cache"]["num_layers"]
    for event in stream:
        if event.step == 0:
            for layer in range(layers):
                key, _ = inspection.read_kv(gen, layer)
                key[:, :, -1] = 3.5
                gen.cache.keys[layer].update_inplace(key)
    for layer in range(layers):
        key, _ = inspection.read_kv(gen, layer)
        assert (key[:, :, -1] == 3.5).all()


def test_fp16_export_runs_with_float16_cache(fp16_export, hf_greedy) -> None:
    gen16 = Generator(fp16_export)
    result = gen16.generate(PROMPTS, max_new_tokens=8, greedy=True)
    assert inspection.read_kv(gen16, 0)[0].dtype == np.float16
    # fp16 rounding may flip a near-tie late in a sequence; the first tokens must agree with fp32 HF.
    assert [tokens[:4] for tokens in result.tokens] == [tokens[:4] for tokens in hf_greedy]


def test_cache_fills_to_exact_capacity_in_place_with_hf_keys(gen, hf_model) -> None:
    # Capacity is exactly prompt + new - 1 positions: every decode step must write its row into the
    # same preallocated buffer (per-step concatenation would outgrow it on the first step). At the
    # end, every row holds what HF's own cache holds for the same tokens.
    prompt, new = PROMPTS[1], 20
    capacity = len(prompt) + new - 1
    result = gen.generate([prompt], max_new_tokens=new, greedy=True, ignore_eos=True, capacity=capacity)
    assert result.steps == new - 1 and len(result.tokens[0]) == new
    tokens = prompt + result.tokens[0][:-1]
    with torch.no_grad():
        hf_cache = hf_model(torch.tensor([tokens]), use_cache=True).past_key_values
    for layer in range(gen.manifest["kv_cache"]["num_layers"]):
        key, value = inspection.read_kv(gen, layer)
        assert key.shape[2] == capacity
        hf_key, hf_value = hf_cache.layers[layer].keys[0].numpy(), hf_cache.layers[layer].values[0].numpy()
        np.testing.assert_allclose(key[0], hf_key, atol=1e-4)
        np.testing.assert_allclose(value[0], hf_value, atol=1e-4)

"""The Triton attention kernel compiled on a CUDA GPU against the torch reference (same grid as the
interpreter tests, plus shapes long enough for the automatic key split). Skips without a GPU."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)", allow_module_level=True)

from attention_cases import CASES, Case, check_case  # noqa: E402

from kvforge.plugins import attention_launch as launch  # noqa: E402

GPU_CASES = [
    # Long caches: the launcher splits the keys on its own (several programs per row block).
    Case("gpu-decode-4k-auto-fp16", 2, 1, 32, 8, 128, 4096, (1000, 4095), "fp16"),
    Case("gpu-decode-16k-auto-bf16-b3", 3, 1, 32, 8, 128, 16384, (0, 9000, 16383), "bf16"),
    Case("gpu-decode-8k-auto-d64-mqa", 1, 1, 16, 1, 64, 8192, (8191,), "fp16"),
    Case("gpu-spec-verify-4-tokens", 2, 4, 32, 8, 128, 4096, (3000, 4092), "bf16"),
    # Prefill with many row blocks and key tiles, with a past, window and softcap.
    Case("gpu-prefill-512-past-fp16", 2, 512, 32, 8, 128, 1024, (0, 400), "fp16"),
    Case("gpu-prefill-300-d256-window-softcap-bf16", 1, 300, 8, 4, 256, 512, (50,), "bf16", 30.0, 128),
    Case("gpu-prefill-fp32", 1, 200, 8, 2, 64, 256, (30,), "fp32"),
]


@pytest.mark.parametrize("case", CASES + GPU_CASES, ids=lambda c: c.name)
def test_compiled_matches_reference(case: Case) -> None:
    check_case(case, "cuda", interpret=False)


def test_long_decode_really_splits() -> None:
    config = launch.choose_config(
        2, 1, 8, 4, 128, 4096, None, torch.cuda.get_device_properties(0).multi_processor_count
    )
    assert config.num_splits > 1

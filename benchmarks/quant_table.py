"""docs/quantisation.md's table: what each quantised export keeps of its fp32 model.

    python benchmarks/quant_table.py HF_DIR EXPORT [EXPORT ...] [--json OUT.json]

For each export, against Hugging Face eager in fp32 on HF_DIR (the model it was exported from):
- perplexity on the first 1024 tokens of kvforge's perplexity text (4 windows of 256, as `kvforge parity`);
- KL divergence KL(fp32 || export), mean over the same 1020 scored positions, from full logits;
- teacher-forced agreement: the export's 32 greedy tokens on each of parity's 3 prompts, and how many of
  them are fp32's argmax after the same prefix (96 in all);
- the France prompt: "What is the capital of France?" in the chat template (a model without one: as
  "Question: ...\nAnswer:"), 96 tokens free-running
  (end of sequence ignored) against fp32's own: the first position that differs, the positions equal,
  and the export's answer up to its first end of turn;
- the folder's size.
Decode speed is measured apart, alternating processes (benchmarks/paired_ratios.py style), since two
exports in one process share caches and cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _fp32(hf_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


def measure(model, export: Path, reference: dict) -> dict:
    import torch

    from kvforge.runtime import GenerationRequest, Generator
    from kvforge.tools.parity import DEFAULT_PROMPTS, PERPLEXITY_WINDOW

    generator = Generator(export)
    ids = reference["ids"]  # the fp32 model's tokens: every export scored on the same ones
    nll, kl = [], []
    for start in range(0, len(ids), PERPLEXITY_WINDOW):
        window = ids[start:start + PERPLEXITY_WINDOW]
        _, logits = generator._prompt_logits(window, "quant_table")  # every position's logits, one prefill
        ours = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), -1)
        with torch.no_grad():
            theirs = torch.log_softmax(model(torch.tensor([window])).logits[0, :-1].double(), -1)
        targets = torch.tensor(window[1:])[:, None]
        nll.append(-ours.gather(1, targets)[:, 0])
        kl.append((theirs.exp() * (theirs - ours)).sum(-1))
    agree = 0
    for text in DEFAULT_PROMPTS:
        prompt = reference["tokenizer"](text)["input_ids"]
        tokens = generator.generate(GenerationRequest([prompt], 32, ignore_eos=True)).tokens[0]
        with torch.no_grad():
            argmax = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(tokens, argmax, strict=True))
    chat = reference["chat"]
    free = generator.generate(GenerationRequest([chat], 96, ignore_eos=True)).tokens[0]
    fp32_free = reference["france_tokens"]
    first = next((i for i, (a, b) in enumerate(zip(free, fp32_free, strict=True)) if a != b), 96)
    answer = generator.tokenizer.decode(free[: next((i for i, t in enumerate(free) if t in generator.eos_token_ids),
                                                     len(free))])
    ppl = float(np.exp(torch.cat(nll).mean().item()))
    return {"export": str(export), "perplexity": round(ppl, 3),
            "perplexity_increase": round(ppl / reference["perplexity"] - 1, 4),
            "kl_mean": round(float(torch.cat(kl).mean()), 5), "agreement": f"{agree}/96",
            "france_first_difference": first, "france_equal": sum(a == b for a, b in zip(free, fp32_free, strict=True)),
            "france_answer": " ".join(answer.split())[:160], "bytes": _folder_bytes(export)}


def fp32_reference(model, hf_dir: Path) -> dict:
    import torch
    from transformers import AutoTokenizer

    from kvforge.tools.parity import PERPLEXITY_TEXT, PERPLEXITY_WINDOW

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = tokenizer(PERPLEXITY_TEXT.read_text())["input_ids"][:1024]
    nll = []
    for start in range(0, len(ids), PERPLEXITY_WINDOW):
        window = ids[start:start + PERPLEXITY_WINDOW]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([window])).logits[0, :-1].double(), -1)
        nll.append(-logp.gather(1, torch.tensor(window[1:])[:, None])[:, 0])
    question = [{"role": "user", "content": "What is the capital of France?"}]
    if tokenizer.chat_template:
        chat = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_dict=True)["input_ids"]
    else:  # a base model without a chat template: the question as plain text
        chat = tokenizer("Question: What is the capital of France?\nAnswer:")["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([chat]), max_new_tokens=96, min_new_tokens=96, do_sample=False)
    return {"perplexity": float(np.exp(torch.cat(nll).mean().item())), "france_tokens": out[0, len(chat):].tolist(),
            "ids": ids, "chat": list(chat), "tokenizer": tokenizer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("exports", type=Path, nargs="+")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model = _fp32(args.hf_dir)
    reference = fp32_reference(model, args.hf_dir)
    rows = [{"export": "fp32 (Hugging Face eager)", "perplexity": round(reference["perplexity"], 3)}]
    for export in args.exports:
        rows.append(measure(model, export, reference))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
